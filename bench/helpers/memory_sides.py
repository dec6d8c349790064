"""The two sides of timing/memory_vs_trl.py: a Qwen2.5-shaped policy with Qwen's real vocabulary (151,936 ids),
written once, and GRPO on it by our `train_grpo` and by TRL 1.16's GRPOTrainer, each recording its peak resident
set and the seconds of its steps. TRL is imported inside `trl_side`, after the side's process has put its anchor
(bench/.anchors/trl-<version>) on sys.path.

The tokenizer is the offline fixture's "qwen2.5-instruct" one (tests/fixtures/real_shapes.py: a byte-level BPE,
Qwen's chat template, <|endoftext|> pad, <|im_end|> eos) with its ordinary vocabulary padded to Qwen's 151,643
entries, the three specials at Qwen's ids (151643 to 151645) and reserved specials up to the model's 151,936
rows, so that any sampled id decodes."""

from __future__ import annotations

import json
import random
import resource
import time
from collections import Counter
from pathlib import Path

VOCAB, ORDINARY = 151_936, 151_643  # Qwen2.5's embedding rows and ordinary tokens
LAYERS = 2  # of Qwen2.5-0.5B's 24: the vocabulary projection, not depth, is what this row measures
PROMPT_TOKENS, TOKENS, SEED = 128, 256, 0  # prompt length (a chat turn), new tokens per completion
BATCH = 8  # completions per step: TRL's default generation batch (per_device_train_batch_size 8 x 1 step)


def peak_mib() -> float:
    """This process's peak resident set so far, MiB (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def record_phase_peaks() -> dict[str, float]:
    """Where our step raises the peak: PhaseTimer (rlhf_core/training/timing.py, which times each phase of a step:
    generate, policy_logprobs, reward, optimize...) wrapped in this process so that every phase during which the
    peak resident set grew records the peak it reached (MiB). The largest entry is the step's peak."""
    from contextlib import contextmanager

    from rlhf_core.training.timing import PhaseTimer

    peaks: dict[str, float] = {}
    timed = PhaseTimer.__call__

    @contextmanager
    def call(self, phase: str):
        before = peak_mib()
        with timed(self, phase):
            yield
        if (after := peak_mib()) > before:
            peaks[phase] = max(peaks.get(phase, 0.0), after)

    PhaseTimer.__call__ = call
    return peaks


def real_vocab_tokenizer():
    """The fixture's qwen2.5-instruct tokenizer grown to Qwen's 151,936 ids (see the module's docstring)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from tests.fixtures.real_shapes import build_tokenizer, family

    spec = family("qwen2.5-instruct")
    data = json.loads(build_tokenizer(spec).backend_tokenizer.to_str())
    vocab, specials = data["model"]["vocab"], data["added_tokens"]
    filler = (f"\u0120w{i}" for i in range(VOCAB))  # byte-level " w<i>": never produced by the merges
    while len(vocab) < ORDINARY:
        vocab.setdefault(next(filler), len(vocab))
    for offset, token in enumerate(specials):
        token["id"] = ORDINARY + offset
    first_reserved = ORDINARY + len(specials)
    reserved = [
        dict(specials[0], id=i, content=f"<|reserved_{i - first_reserved}|>") for i in range(first_reserved, VOCAB)
    ]
    data["added_tokens"] = specials + reserved
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(data)),
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
        eos_token=spec.eos,
        pad_token=spec.pad,
    )
    tokenizer.chat_template = spec.chat_template
    return tokenizer, spec


def qwen_body(ids, layers: int = LAYERS, *, vocab: int = VOCAB, width: int = 896, heads: int = 14, seed: int = SEED):
    """A Qwen2.5-0.5B-shaped Qwen2ForCausalLM (hidden 896, 14 heads, 2 KV heads, intermediate 4864, tied
    embeddings, rope_theta 1e6, 151,936 rows) with `layers` layers and seeded random weights; `vocab`, `width` and
    `heads` for a narrower body (intermediate 2 x width below 896)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=4864 if width == 896 else 2 * width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        rope_theta=1e6,
        bos_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"),
    )
    model = Qwen2ForCausalLM(config)
    stops = [ids("<|im_end|>"), ids("<|endoftext|>")]
    model.generation_config = GenerationConfig(eos_token_id=stops, pad_token_id=ids("<|endoftext|>"))
    return model


def same_length_prompts(tokenizer, n: int, tokens: int = PROMPT_TOKENS) -> list[str]:
    """`n` chat-templated user turns (tests/fixtures/team_data.py's text, as bench/studies/gpu_real_sizes.py
    makes them) all of one token length near `tokens`: whichever prompts a side's sampler draws, both sides
    score sequences of the same length."""
    from tests.fixtures.team_data import user_text

    rng, by_length = random.Random(SEED), {}
    while True:
        messages = [{"role": "user", "content": user_text(rng, tokenizer, tokens - 8)}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        by_length.setdefault(len(tokenizer(text)["input_ids"]), []).append(text)
        length, count = Counter({k: len(v) for k, v in by_length.items()}).most_common(1)[0]
        if count >= n:
            return by_length[length][:n]


def write_policy(root: Path, prompts: int) -> Path:
    """The policy directory both sides load (weights, tokenizer) and prompts.json beside it."""
    from tests.fixtures.real_shapes import save_tokenizer

    tokenizer, spec = real_vocab_tokenizer()
    path = root / "policy"
    qwen_body(tokenizer.convert_tokens_to_ids).save_pretrained(path, safe_serialization=True)
    save_tokenizer(tokenizer, spec, path)
    (root / "prompts.json").write_text(json.dumps(same_length_prompts(tokenizer, prompts)))
    return path


def text_length(prompts, completions, **kwargs):
    """The reward of both sides: the completion's length in characters, / 1000 (it varies within a group)."""
    return [len(c) / 1000 for c in completions]


def step_seconds(stamps: list[float]) -> float:
    """Mean seconds per step from the times the steps ended, the first (warm-up) step left out."""
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def ours_side(root: Path, *, steps: int, generations: int, micro_batches: int, checkpointing: bool | None) -> dict:
    """Our `train_grpo` for `steps` steps of one generation batch (BATCH completions, TRL's default), split into
    `micro_batches` forward/backward passes (rl.gradient_accumulation_steps: one optimizer step per batch);
    `checkpointing` None: model.gradient_checkpointing unset, on for every model but the demo (the RL stage's
    `prepare_for_training`)."""
    from bench.helpers.anchors import phase_means
    from rlhf_core.config import GRPOConfig, ModelConfig, RLConfig, RunConfig
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer, prepare_for_training
    from rlhf_core.rewards.sources import function_reward
    from rlhf_core.rl.grpo import train_grpo
    from rlhf_core.rl.inputs import rl_inputs

    path = root / "policy"
    tokenizer, policy = load_tokenizer(str(path)), load_causal_lm(str(path))
    model = ModelConfig(base=str(path), gradient_checkpointing=checkpointing)
    prepare_for_training(policy, gradient_checkpointing=model.checkpointing)
    loaded, phase_peaks = peak_mib(), record_phase_peaks()
    stamps, at_last_step, logged = [], {}, []

    def on_log(metrics, step):
        stamps.append(time.perf_counter())
        logged.append(metrics)
        if step == steps:  # the peak of training, before the loop's closing checkpoint is written
            at_last_step.update(peak=peak_mib(), phases=dict(phase_peaks))

    rl = RLConfig(
        algorithm="grpo",
        total_steps=steps,
        batch_size=BATCH,
        gradient_accumulation_steps=micro_batches,
        learning_rate=1e-6,
        response_length=TOKENS,
        min_response_length=TOKENS,
        temperature=1.0,
        save_steps=steps,
        log_steps=1,
    )
    ids, prompts = tokenizer.convert_tokens_to_ids, json.loads((root / "prompts.json").read_text())
    train_grpo(
        rl_inputs(
            policy,
            tokenizer,
            [{"prompt": p} for p in prompts],
            root / f"ours-{time.time_ns()}",
            reference=None,
            rewards=[function_reward("text_length", 1.0, text_length)],
            rl=rl,
            grpo=GRPOConfig(num_generations=generations, beta=0.0),
            run=RunConfig(device="cpu", seed=SEED),
            max_prompt_length=512,
            stop_token_ids=[ids("<|im_end|>"), ids("<|endoftext|>")],
            show_progress=False,
            on_log=on_log,
        )
    )
    return {
        "seconds_per_step": step_seconds(stamps),
        "peak_mib": at_last_step["peak"],
        "loaded_mib": loaded,
        "checkpointing": model.checkpointing,
        "micro_batch": rl.batch_size // micro_batches,
        "prompt_tokens": len(tokenizer(prompts[0])["input_ids"]),
        "phase_s": phase_means(logged[1:]),
        "phase_peak_mib": at_last_step["phases"],
    }


def trl_side(root: Path, *, steps: int, generations: int, overrides: dict) -> dict:
    """TRL's GRPOTrainer at its GRPOConfig defaults (per_device_train_batch_size 8, steps_per_generation 1,
    gradient_checkpointing on, beta 0, temperature 1.0) but CPU, fp32, exactly TOKENS new tokens per completion,
    `generations` per prompt, `steps` optimizer steps, no checkpoint, no reporting; `overrides` on top."""
    import datasets
    import trl
    from transformers import AutoModelForCausalLM, TrainerCallback

    from bench.helpers.trl_sides import left_padded_tokenizer

    path = root / "policy"
    stamps = []

    class Stamps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    config = trl.GRPOConfig(
        output_dir=str(root / f"trl-{time.time_ns()}"),
        num_generations=generations,
        max_completion_length=TOKENS,
        generation_kwargs={"min_new_tokens": TOKENS},
        max_steps=steps,
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        logging_steps=1,
        report_to=[],
        seed=SEED,
        disable_tqdm=True,
        **overrides,
    )
    trainer = trl.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(path),
        reward_funcs=[text_length],
        args=config,
        train_dataset=datasets.Dataset.from_dict({"prompt": json.loads((root / "prompts.json").read_text())}),
        processing_class=left_padded_tokenizer(path),
        callbacks=[Stamps()],
    )
    loaded = peak_mib()
    trainer.train()
    return {
        "seconds_per_step": step_seconds(stamps),
        "peak_mib": peak_mib(),
        "loaded_mib": loaded,
        "checkpointing": config.gradient_checkpointing,
        "micro_batch": config.per_device_train_batch_size,
    }
