"""TRL 1.12 side of the PPO parity test: run the real `PPOTrainer.train()` for one batch, record its tensors.

Run only in a subprocess whose PYTHONPATH starts with .venv/trl-1.12.0, so that `import trl` is TRL 1.12.0
(the last release with PPOTrainer); the test process itself never imports it. Usage:

    python trl112_ppo_side.py SPEC.json

SPEC names the tiny models and tokenizers the test saved (policy, ref, value, reward), and for each run the
prompts, the fixed responses, the PPO settings and where to write `<name>.safetensors` + `<name>.json`.

What is TRL's own code here: everything in `PPOTrainer.__init__` and `train()` (truncate_response, the
sequence lengths, get_reward for scores and values, the reference forward, INVALID_LOGPROB, padding_mask(_p1),
the KL estimators, the reward placement, reward whitening, the GAE loop, advantage whitening, returns).
Four names in the trainer's module are wrapped, each calling the original or TRL's own functions:
- `batch_generation`: the responses are the test's fixed tokens instead of samples (one per prompt, found
  by the query's tokens; `prompt_index` records each row's prompt); the "generation logits"
  are the policy's logits at those tokens from TRL's own `forward`, divided by generation_config.temperature
  (= args.temperature + 1e-7), as HF generate's temperature warper does to `output.scores`.
- `masked_whiten`: records its inputs (raw rewards / raw advantages) and calls the original.
- `get_reward`: records the reward model's raw scores (before missing_eos_penalty) and calls the original.
- `empty_cache`: the first call after `returns` exists in train()'s frame (right after the advantages are
  whitened) copies train()'s locals: rewards, advantages, returns, values, scores, kl, masks, ...
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
import trl  # noqa: E402

if trl.__version__ != "1.12.0":
    raise SystemExit(f"expected trl 1.12.0 on PYTHONPATH, got {trl.__version__} from {trl.__file__}")

import trl.experimental.ppo.ppo_trainer as ppo_mod  # noqa: E402
from datasets import Dataset  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedTokenizerFast,
)
from trl.experimental.ppo import PPOConfig, PPOTrainer  # noqa: E402

FRAME_NAMES = (
    "queries",
    "responses",
    "postprocessed_responses",
    "logprobs",
    "ref_logprobs",
    "values",
    "scores",
    "sequence_lengths",
    "sequence_lengths_p1",
    "contain_eos_token",
    "padding_mask",
    "padding_mask_p1",
    "kl",
    "non_score_reward",
    "rewards",
    "actual_end",
    "advantages",
    "returns",
)


def run_one(run: dict, models: dict, out_dir: Path) -> None:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(run["tokenizer_dir"])
    tokenizer.padding_side = "left"
    policy = AutoModelForCausalLM.from_pretrained(models["policy"])
    ref = AutoModelForCausalLM.from_pretrained(models["ref"])
    value = AutoModelForSequenceClassification.from_pretrained(models["value"])
    reward = AutoModelForSequenceClassification.from_pretrained(models["reward"])
    # the response of each prompt is fixed, whatever row the shuffled dataloader puts the prompt in
    by_prompt = {tuple(p): i for i, p in enumerate(run["prompts"])}
    fixed = torch.tensor(run["responses"], dtype=torch.long)
    batch = fixed.shape[0]
    cfg = run["ppo"]

    captured: dict[str, torch.Tensor] = {}
    originals = {
        name: getattr(ppo_mod, name) for name in ("batch_generation", "masked_whiten", "get_reward", "empty_cache")
    }

    def batch_generation(model, queries, local_rollout_forward_batch_size, pad_token_id, generation_config):
        assert queries.shape[0] == batch, queries.shape
        rows = [by_prompt[tuple(q[q != pad_token_id].tolist())] for q in queries.cpu()]  # prompts hold no pad id
        captured["prompt_index"] = torch.tensor(rows)
        query_responses = torch.cat([queries, fixed[rows].to(queries.device)], dim=1)
        context = queries.shape[1]
        with torch.no_grad():
            logits = ppo_mod.forward(model, query_responses, pad_token_id).logits[:, context - 1 : -1]
        captured["generation_temperature"] = torch.tensor(float(generation_config.temperature), dtype=torch.float64)
        return query_responses, logits / generation_config.temperature

    def masked_whiten(values, mask, shift_mean=True):
        out = originals["masked_whiten"](values, mask, shift_mean=shift_mean)
        key = "whiten_advantages" if shift_mean else "whiten_rewards"
        captured[f"{key}_in"] = values.detach().clone()
        captured[f"{key}_mask"] = mask.detach().clone()
        captured[f"{key}_out"] = out.detach().clone()
        return out

    def get_reward(model, query_responses, pad_token_id, context_length):
        result = originals["get_reward"](model, query_responses, pad_token_id, context_length)
        if model is reward:
            captured["raw_scores"] = result[1].detach().clone()
            captured["reward_index"] = result[2].detach().clone()  # the column of query+response scored
            captured["scored_query_responses"] = query_responses.detach().clone()
        return result

    def empty_cache():
        frame = sys._getframe(1)
        if "frame_returns" not in captured and "returns" in frame.f_locals:
            local = frame.f_locals
            for name in FRAME_NAMES:
                captured[f"frame_{name}"] = local[name].detach().clone()
            captured["context_length"] = torch.tensor(local["context_length"])
        return originals["empty_cache"]()

    try:
        ppo_mod.batch_generation, ppo_mod.masked_whiten = batch_generation, masked_whiten
        ppo_mod.get_reward, ppo_mod.empty_cache = get_reward, empty_cache
        with tempfile.TemporaryDirectory() as tmp:
            args = PPOConfig(
                output_dir=tmp,
                report_to="none",
                save_strategy="no",
                use_cpu=True,
                bf16=False,
                fp16=False,
                gradient_checkpointing=False,
                disable_tqdm=True,
                seed=run.get("seed", 0),
                per_device_train_batch_size=batch,
                gradient_accumulation_steps=1,
                num_mini_batches=1,
                num_ppo_epochs=1,
                total_episodes=batch,
                num_sample_generations=0,
                local_rollout_forward_batch_size=batch,
                response_length=fixed.shape[1],
                stop_token="eos",
                temperature=cfg["temperature"],
                kl_coef=cfg["kl_coef"],
                kl_estimator=cfg["kl_estimator"],
                whiten_rewards=cfg["whiten_rewards"],
                gamma=cfg["gamma"],
                lam=cfg["lam"],
                missing_eos_penalty=cfg["missing_eos_penalty"],
            )
            trainer = PPOTrainer(
                args=args,
                processing_class=tokenizer,
                model=policy,
                ref_model=ref,
                reward_model=reward,
                train_dataset=Dataset.from_dict({"input_ids": run["prompts"]}),
                value_model=value,
            )
            trainer.train()
    finally:
        for name, fn in originals.items():
            setattr(ppo_mod, name, fn)
    if "frame_returns" not in captured:
        raise SystemExit(f"{run['name']}: train() never reached the capture point")

    tensors = {k: v.contiguous().cpu() for k, v in captured.items()}
    save_file(tensors, str(out_dir / f"{run['name']}.safetensors"))
    meta = {
        "trl_version": trl.__version__,
        "trl_file": trl.__file__,
        "ppo_trainer_file": ppo_mod.__file__,
        "stop_token_id": trainer.stop_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "args_temperature": args.temperature,
    }
    (out_dir / f"{run['name']}.json").write_text(json.dumps(meta, indent=1))


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)  # tiny models: one thread is fastest, and leaves a core to others
    # train() calls gc.collect() a few times; with the imported modules moved out of the collector's reach
    # each call takes milliseconds instead of ~0.5 s (nothing of TRL's computation depends on it)
    gc.collect()
    gc.freeze()
    out_dir = Path(spec["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    for run in spec["runs"]:
        run_one(run, spec["models"], out_dir)


if __name__ == "__main__":
    main()
