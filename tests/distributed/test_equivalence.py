"""Equivalences the training code promises, checked against a reference run of a different shape.

1. Log-probabilities and entropies at a temperature other than 1 are those of log_softmax(logits / T)
   of a plain full forward (no logits_to_keep), on left-padded prompts and right-padded responses.
2. Gradient accumulation: one optimizer step over 4 micro-batches of B is one step over 4B (PPO; GRPO
   with the dapo, grpo, dr_grpo and cispo losses): the same gradients, the same weights.
3. Data parallel: 2 processes x B rows are 1 process x 2B rows (PPO with global whitening; GRPO with
   dapo and batch-scaled rewards): the same gradients and weights after every step.

The runs live in tests/distributed/equivalence_worker.py. Where sampling would differ (data parallel:
seed + rank), the rollouts are fixed functions of the prompts with varying lengths (so that token
normalizations matter); the log-probabilities still come from the real models and code. Every
comparison also checks that both runs saw the very same responses.

Tolerances. Gradients (the sharp check: Adam's update is nearly scale-free, so a mis-normalized loss
shows in the gradients, hardly in the weights) must agree to GRAD_RTOL of their global norm, tensor by
tensor. Weights must agree to WEIGHT_ATOL = a tenth of one step's update at lr 1e-3: Adam divides by
sqrt(v) + 1e-8, so a gradient element of about 1e-8 turns float-rounding noise into a visible
fraction of lr (1.5e-5 observed in one element out of ~10^5).

Also: two CPU processes (gloo, torchrun, tests/distributed/dp_worker.py) training reward, PPO and GRPO keep
identical weights after every step, with one writer of checkpoints and logs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.models.forward import response_logprobs
from rlhf_core.models.loading import load_causal_lm, load_tokenizer, stop_token_ids
from rlhf_core.rl_math import INVALID_LOGPROB, response_mask
from rlhf_core.rollout.generation import left_pad, tokenize_prompts

REPO = Path(__file__).resolve().parents[2]


WORKER_PATH = REPO / "tests" / "distributed" / "equivalence_worker.py"


GRAD_RTOL = 2e-4  # every tensor: ||g_a - g_b|| <= GRAD_RTOL x the norm of the whole optimizer step's gradient


WEIGHT_ATOL = 1e-4  # elementwise, lr 1e-3 (see the module docstring)


LOGPROB_ATOL = 1e-5


# entropy = logsumexp(z) - sum(p z) (as TRL) cancels: float32 error about 1e-6 x max|z| (z = logits / T)
ENTROPY_ATOL = 2e-5


STOPS = (4, 2)  # the demo's stop ids, <|im_end|> then <|endoftext|> (its eos == pad)


def _load_worker():
    spec = importlib.util.spec_from_file_location("equivalence_worker", WORKER_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


worker = _load_worker()


def load_steps(out: Path, stage: str, tag: str, steps: int) -> list[dict[str, torch.Tensor]]:
    return [load_file(str(out / f"{stage}-{tag}-step{step}.safetensors")) for step in range(1, steps + 1)]


def deviations(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """Largest weight difference (elementwise) and largest gradient difference (per tensor, relative to the
    optimizer step's global gradient norm) between two recorded steps."""
    assert set(a) == set(b), set(a) ^ set(b)
    weight = max((a[k] - b[k]).abs().max().item() for k in a if k.startswith("w."))
    grad = 0.0
    for j in sorted({k.split(".", 1)[0] for k in a if k.startswith("g")}):
        keys = [k for k in a if k.startswith(j + ".")]
        norm = torch.stack([b[k].norm() for k in keys]).norm().item()
        assert norm > 0, f"{j}: no gradient at all"
        grad = max(grad, max((a[k] - b[k]).norm().item() for k in keys) / norm)
    return {"weight": weight, "grad": grad}


def assert_equivalent(runs_a: list[dict], runs_b: list[dict], what: str, initial: dict[str, torch.Tensor]) -> None:
    """Step by step: the same responses, gradients within GRAD_RTOL, weights within WEIGHT_ATOL; and the
    policy moved well beyond the tolerance (else the comparison would say nothing)."""
    for step, (a, b) in enumerate(zip(runs_a, runs_b, strict=True), start=1):
        assert torch.equal(a["responses"], b["responses"]), f"{what} step {step}: the runs saw different responses"
        found = deviations(a, b)
        print(f"{what} step {step}: max |dw| {found['weight']:.2e}, max |dg|/|g| {found['grad']:.2e}")
        assert found["grad"] <= GRAD_RTOL, f"{what} step {step}: gradients differ by {found['grad']:.3e} of their norm"
        assert found["weight"] <= WEIGHT_ATOL, f"{what} step {step}: weights differ by up to {found['weight']:.3e}"
    moved = max((runs_b[-1][f"w.policy.{k}"] - v).abs().max().item() for k, v in initial.items())
    assert moved > 10 * WEIGHT_ATOL, f"{what}: the policy hardly moved ({moved:.2e}); the comparison says nothing"


@pytest.fixture(scope="module")
def initial(smoke_world) -> dict[str, torch.Tensor]:
    """The policy's weights before training."""
    return {k: v.detach().clone() for k, v in load_causal_lm(str(smoke_world.base_model)).state_dict().items()}


def assert_lengths_vary(out: Path, stage: str, tag: str) -> None:
    for step in load_steps(out, stage, tag, 2):
        lengths = response_mask(step["responses"], STOPS)[0].sum(1)
        assert len(set(lengths.tolist())) > 1, lengths


PPO_BATCH, GRPO_BATCH = 4, 8  # per process; the single process takes twice as many


@pytest.fixture(scope="module")
def data_parallel_runs(tmp_path_factory, smoke_world):
    """torchrun with 2 CPU processes (gloo) x B, then this process alone x 2B, each recorded step by step."""
    out = tmp_path_factory.mktemp("equivalence")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            str(Path(sys.executable).with_name("torchrun")),
            "--standalone",
            "--nproc_per_node",
            "2",
            str(WORKER_PATH),
            str(smoke_world.root),
            str(out),
            str(PPO_BATCH),
            str(GRPO_BATCH),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    worker.run_ppo(smoke_world.root, out, 2 * PPO_BATCH, "single")
    worker.run_grpo(smoke_world.root, out, 2 * GRPO_BATCH, "single")
    return out


def check_data_parallel(out: Path, stage: str, initial: dict[str, torch.Tensor]) -> None:
    ranks = [load_steps(out, stage, f"rank{r}", 2) for r in (0, 1)]
    single = load_steps(out, stage, "single", 2)
    for step, (r0, r1) in enumerate(zip(*ranks), start=1):
        # DDP: both processes hold the very same weights and averaged gradients
        for key in r0.keys() - {"responses"}:
            assert torch.equal(r0[key], r1[key]), f"{stage} step {step}: the processes disagree on {key}"
    # the processes hold different numbers of response tokens: the token normalizations matter
    tokens = [[int(response_mask(r["responses"], STOPS)[0].sum()) for r in rank] for rank in ranks]
    assert tokens[0] != tokens[1], tokens
    # the processes' responses, in rank order, are the single process's batch; then the same gradients and weights
    joined = [{**a, "responses": torch.cat([a["responses"], b["responses"]])} for a, b in zip(*ranks)]
    assert_equivalent(joined, single, f"{stage} 2 processes x B vs 1 x 2B", initial)


def test_response_logprobs_at_a_temperature_match_a_plain_full_forward(smoke_world):
    tok = load_tokenizer(str(smoke_world.tokenizer))
    model = load_causal_lm(str(smoke_world.base_model)).eval()
    with torch.no_grad():  # the random model is nearly uniform over its vocabulary: sharpen it (logits up to ~10)
        model.model.norm.weight.mul_(8.0)
    prompts = worker.train_prompts(smoke_world.root)
    # prompts of different token lengths: real left padding
    by_length = {}
    for ids in tokenize_prompts(tok, prompts, 16):
        by_length.setdefault(len(ids), ids)
    ids = list(by_length.values())[:5]
    assert len({len(s) for s in ids}) == len(ids) >= 3
    query, query_mask = left_pad(ids, tok.pad_token_id)
    R = 6
    eos = stop_token_ids(tok, model.generation_config)
    responses = torch.randint(4, len(tok), (len(ids), R), generator=torch.Generator().manual_seed(0))
    for row, length in enumerate([R, 1, 3, 5, 2][: len(ids)]):  # R: never stops; else the stop token ends it
        if length < R:
            responses[row, length - 1] = eos[0]
            responses[row, length:] = tok.pad_token_id
    mask, _, has_stop = response_mask(responses, eos)
    assert not has_stop[0] and has_stop[1:].all() and mask.sum(1).tolist() == [R, 1, 3, 5, 2][: len(ids)]

    T = 0.7
    with torch.no_grad():
        logp, entropy = response_logprobs(model, query, query_mask, responses, mask, temperature=T, with_entropy=True)
        logp_t1, _ = response_logprobs(model, query, query_mask, responses, mask, temperature=1.0)

        # by hand, batched: the full forward over every position (no logits_to_keep), positions from the mask
        input_ids = torch.cat([query, responses], 1)
        attention = torch.cat([query_mask, mask], 1)
        logits = model(
            input_ids=input_ids, attention_mask=attention, position_ids=(attention.cumsum(1) - 1).clamp(min=0)
        ).logits.float()
        Q = query.shape[1]
        scaled = logits[:, Q - 1 : Q - 1 + R] / T
        logsm = scaled.log_softmax(-1)
        batched_logp = logsm.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        batched_entropy = -(logsm.exp() * logsm).sum(-1)

        # by hand, one row at a time with no padding at all (default positions 0..n-1)
        for row in range(len(ids)):
            n = int(mask[row].sum())
            seq = torch.tensor(ids[row] + responses[row, :n].tolist()).unsqueeze(0)
            row_logsm = (model(input_ids=seq).logits[0].float() / T).log_softmax(-1)[len(ids[row]) - 1 : -1]
            hand_logp = row_logsm.gather(-1, responses[row, :n].unsqueeze(-1)).squeeze(-1)
            hand_entropy = -(row_logsm.exp() * row_logsm).sum(-1)
            torch.testing.assert_close(logp[row, :n], hand_logp, atol=LOGPROB_ATOL, rtol=0)
            torch.testing.assert_close(entropy[row, :n], hand_entropy, atol=ENTROPY_ATOL, rtol=0)

    real = mask.bool()
    torch.testing.assert_close(logp[real], batched_logp[real], atol=LOGPROB_ATOL, rtol=0)
    torch.testing.assert_close(entropy[real], batched_entropy[real], atol=ENTROPY_ATOL, rtol=0)
    assert (logp[~real] == INVALID_LOGPROB).all()
    # the temperature really is applied: T = 1 gives clearly different numbers
    assert (logp_t1[real] - logp[real]).abs().max() > 1.0
    assert entropy[real].min() < 0.5 * torch.log(torch.tensor(float(len(tok))))


@pytest.mark.parametrize("sampler", ["real", "forced"])
def test_ppo_accumulating_four_micro_batches_is_one_big_batch(tmp_path, smoke_world, initial, sampler):
    deterministic = sampler == "forced"
    whole = worker.run_ppo(smoke_world.root, tmp_path, 8, "ga1", deterministic=deterministic)
    accumulated = worker.run_ppo(
        smoke_world.root, tmp_path, 8, "ga4", rl={"gradient_accumulation_steps": 4}, deterministic=deterministic
    )
    assert len(whole.grads) == len(accumulated.grads) == 2  # one optimizer step per iteration in both
    if deterministic:
        assert_lengths_vary(tmp_path, "ppo", "ga1")
    assert_equivalent(
        load_steps(tmp_path, "ppo", "ga4", 2), load_steps(tmp_path, "ppo", "ga1", 2), f"ppo ga ({sampler})", initial
    )


@pytest.mark.parametrize(
    "loss_type,sampler",
    [("dapo", "real"), ("dapo", "forced"), ("grpo", "forced"), ("dr_grpo", "forced"), ("cispo", "forced")],
)
def test_grpo_accumulating_four_micro_batches_is_one_big_batch(tmp_path, smoke_world, initial, loss_type, sampler):
    deterministic = sampler == "forced"
    grpo = {"loss_type": loss_type, **({"epsilon_high": 5.0} if loss_type == "cispo" else {})}
    whole = worker.run_grpo(smoke_world.root, tmp_path, 8, "ga1", grpo=grpo, deterministic=deterministic)
    accumulated = worker.run_grpo(
        smoke_world.root,
        tmp_path,
        8,
        "ga4",
        grpo=grpo,
        rl={"gradient_accumulation_steps": 4},
        deterministic=deterministic,
    )
    assert len(whole.grads) == len(accumulated.grads) == 4  # num_iterations 2: two optimizer steps per iteration
    if deterministic:
        assert_lengths_vary(tmp_path, "grpo", "ga1")
    assert_equivalent(
        load_steps(tmp_path, "grpo", "ga4", 2),
        load_steps(tmp_path, "grpo", "ga1", 2),
        f"grpo {loss_type} ga ({sampler})",
        initial,
    )


@pytest.mark.slow
def test_ppo_two_processes_are_one_process_with_twice_the_batch(data_parallel_runs, initial):
    check_data_parallel(data_parallel_runs, "ppo", initial)


@pytest.mark.slow
def test_grpo_two_processes_are_one_process_with_twice_the_batch(data_parallel_runs, initial):
    check_data_parallel(data_parallel_runs, "grpo", initial)


@pytest.mark.slow
def test_two_processes_train_reward_ppo_and_grpo_with_identical_weights(tmp_path, smoke_world):
    out = tmp_path / "dp"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            str(Path(sys.executable).with_name("torchrun")),
            "--standalone",
            "--nproc_per_node",
            "2",
            str(REPO / "tests" / "distributed" / "dp_worker.py"),
            str(smoke_world.root),
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    traces = [[json.loads(line) for line in (out / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    for stage, steps in (("reward", 3), ("ppo", 2), ("grpo", 2)):
        weights = [[e["weights"] for e in t if e["stage"] == stage and "step" in e] for t in traces]
        assert len(weights[0]) == steps and weights[0] == weights[1], f"{stage}: the processes disagree: {weights}"
        assert len(set(weights[0])) == steps, f"{stage}: the weights did not change every step"
        # metrics are logged by the main process only
        assert [e["log"] for e in traces[0] if e["stage"] == stage and "log" in e] == list(range(1, steps + 1))
        assert not [e for e in traces[1] if e["stage"] == stage and "log" in e]
    assert [e["metrics"] for e in traces[0] if e["stage"] == "reduce"] == [
        {"loss": 0.5, "tokens": 7.0},
        {"low": 2.0, "high": 10.0, "mean": 0.5, "n": 2.0},
    ]
    # identical weights, but each process samples with its own seed (run.seed + rank)
    assert [{e["sampling_seed"] for e in t if e["stage"] == "grpo" and "step" in e} for t in traces] == [{3}, {4}]
    # PPO's episode counts the prompts of both processes
    assert [e["episode"] for e in traces[0] if e["stage"] == "ppo" and "log" in e] == [8.0, 16.0]
    # one writer: each checkpoint exists once and no temporary directory is left behind
    assert sorted(p.name for p in (out / "reward").iterdir()) == ["checkpoint-3"]
    assert sorted(p.name for p in (out / "ppo").iterdir()) == ["checkpoint-2"]
    assert sorted(p.name for p in (out / "grpo").iterdir()) == ["checkpoint-2"]


@pytest.mark.parametrize(
    "algorithm,grpo",
    [("rloo", {"normalize_advantages": True}), ("reinforce_plus_plus", {"gamma": 0.9})],
)
def test_rloo_and_reinforce_pp_accumulating_four_micro_batches_is_one_big_batch(
    tmp_path, smoke_world, initial, algorithm, grpo
):
    """The other group estimators (KL in the reward, beta 0.04; RLOO's sequence loss, REINFORCE++'s per-token
    advantages under dapo): 4 accumulated micro-batches train as the whole batch."""
    rl = {"algorithm": algorithm}
    worker.run_grpo(smoke_world.root, tmp_path, 8, "ga1", grpo=grpo, rl=rl)
    worker.run_grpo(smoke_world.root, tmp_path, 8, "ga4", grpo=grpo, rl={**rl, "gradient_accumulation_steps": 4})
    assert_equivalent(
        load_steps(tmp_path, "grpo", "ga4", 2),
        load_steps(tmp_path, "grpo", "ga1", 2),
        f"{algorithm} ga",
        initial,
    )
