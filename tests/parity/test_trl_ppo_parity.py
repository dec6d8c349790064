"""PPO parity with TRL 1.12's PPOTrainer: the same tensors through our PPO math and through TRL's own code.

TRL 1.12.0 (the last release with PPOTrainer) lives apart from the venv's TRL 1.16, in .venv/trl-1.12.0
(`make venv`), and runs only in a subprocess (tests/parity/trl112_ppo_side.py) whose PYTHONPATH starts with
it: that script runs the real `PPOTrainer.train()` for exactly one batch on tiny seeded Llama models built
here, with the responses fixed by this test, and records TRL's scores, values, log-probabilities, per-token
rewards, advantages (raw and whitened) and returns. This process then runs OUR pieces on the same inputs:
`response_mask`, `score_rollout` / `sequence_scores` / `token_values`, `response_logprobs`, and the math of
`train_ppo` (kl_per_token * mask -> kl_penalized_rewards -> [masked_whiten rewards] -> compute_gae ->
masked_whiten advantages * mask), and compares. test_train_ppo_end_to_end then runs our real `train_ppo` for
one iteration on the same models, prompts and responses (generation replaced, nothing else) and checks
that what it computes is that math, and for responses that never stop, TRL's tensors themselves.
Each prompt has a fixed response on both sides; rows are put in prompt order before comparing.

Runs (batch 8, response length 8, kl_coef > 0, gamma 0.99, lam 0.9, temperature 0.7):
- full_*: no response stops (all run to response_length): TRL and we must agree exactly.
- stop_*: pad != eos, responses stop early: the one documented difference is where the score goes.
  We add it on the stop token itself (the last real token); TRL adds it one past the last real token
  (sequence_lengths + 1, "padding_mask_p1"), unless that is past the end, and keeps the value there too.
  TRL's result equals ours with the score moved one position later and the values kept to last + 1.
- padeos_*: pad == eos (GPT-2 / Qwen2.5-base shape). TRL finds the end as "first pad" - 1, i.e. the token
  before the eos: see test_pad_equals_eos.
Each run in a k1 and a k3 / whiten_rewards variant.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.ppo import compute_gae, kl_penalized_rewards, score_rollout
from rlhf_core.rl_math import kl_per_token, masked_whiten, response_mask
from rlhf_core.rollout import Rollout, response_logprobs, sequence_scores, token_values

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("trl112_ppo_side.py")

# float32 throughout; the math on identical inputs agrees to ~1e-7, model forwards to ~1e-6
ATOL_MATH = 1e-5
ATOL_MODEL = 1e-5

VOCAB, RESPONSE_LENGTH, BATCH = 64, 8, 8
PAD, UNK, BOS, EOS = 0, 1, 2, 3  # ids in the test vocabulary; words are 4..63
SETTINGS = dict(temperature=0.7, gamma=0.99, lam=0.9)

MAX_DIFFS: dict[str, float] = {}  # name -> max abs diff reached, printed at the end (pytest -s / -rA)


TRL112_CANDIDATES = tuple(
    dict.fromkeys([Path(sys.executable).parents[1] / "trl-1.12.0", REPO / ".venv" / "trl-1.12.0"])
)


def trl112_dir() -> Path | None:
    for candidate in TRL112_CANDIDATES:
        if (candidate / "trl" / "experimental" / "ppo" / "ppo_trainer.py").is_file():
            return candidate
    return None


MISSING = (
    "TRL 1.12.0 is not installed apart: expected "
    + " or ".join(str(c) for c in TRL112_CANDIDATES)
    + " to hold trl/experimental/ppo/ppo_trainer.py. Run `make venv`, or: .venv/bin/python -m pip install"
    " --no-deps --target .venv/trl-1.12.0 trl==1.12.0"
)


# ----------------------------------------------------------------------------------------------- fixtures


def build_tokenizer(pad_is_eos: bool):
    """A word-level fast tokenizer over the 64 ids; pad is its own token, or the eos (GPT-2 shape)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<unk>": UNK, "<bos>": BOS, "<eos>": EOS, **{f"w{i}": i for i in range(4, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<eos>" if pad_is_eos else "<pad>",
        padding_side="left",
    )


def build_models() -> dict[str, torch.nn.Module]:
    """Tiny seeded Llamas; a wide init so that log-probabilities, KL, values and scores are O(0.1-1)."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    def config(**extra):
        return LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
            initializer_range=0.3,
            pad_token_id=PAD,
            bos_token_id=BOS,
            eos_token_id=EOS,
            **extra,
        )

    out = {}
    for seed, (name, cls) in enumerate(
        [
            ("policy", LlamaForCausalLM),
            ("value", LlamaForSequenceClassification),
            ("reward", LlamaForSequenceClassification),
        ]
    ):
        torch.manual_seed(1000 + seed)
        out[name] = cls(config(num_labels=1) if cls is LlamaForSequenceClassification else config()).float().eval()
    # the reference: the policy a little moved (per-token KL ~0.3-0.5; two independent inits give ~3-70)
    torch.manual_seed(1003)
    out["ref"] = LlamaForCausalLM(config()).float().eval()
    with torch.no_grad():
        for ref_param, param in zip(out["ref"].parameters(), out["policy"].parameters()):
            ref_param.copy_(param + 0.02 * torch.randn_like(param))
    return out


def make_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [[BOS] + torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (1, 3, 2, 4, 2, 3, 1, 4)]


def make_responses(stops: list[int | None], pad: int, seed: int) -> list[list[int]]:
    """Word tokens; row i has the eos at stops[i] and pad after it (as HF generate pads), or no eos at all."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(4, VOCAB, (len(stops), RESPONSE_LENGTH), generator=g)
    for i, s in enumerate(stops):
        if s is not None:
            rows[i, s] = EOS
            rows[i, s + 1 :] = pad
    return rows.tolist()


FULL = [None] * BATCH
# early stops everywhere, a stop at 0 (ours and TRL agree on it when pad != eos), one on the last position
# (TRL's last + 1 is then past the end: same as ours), and two rows that never stop
STOPS = [2, None, 0, 7, 5, 1, None, 3]
STOPS_PADEOS = [2, None, 4, 7, 5, 1, None, 3]  # no stop at 0: see test_pad_equals_eos

RUNS = {
    # name: (pad is eos, stop positions, response seed, kl estimator, whiten rewards, missing_eos_penalty)
    "full_k1": (False, FULL, 11, "k1", False, None),
    "full_k3_whiten": (False, FULL, 12, "k3", True, 1.0),
    "stop_k1": (False, STOPS, 13, "k1", False, 1.0),
    "stop_k3_whiten": (False, STOPS, 14, "k3", True, None),
    "padeos_k1": (True, STOPS_PADEOS, 15, "k1", False, 1.0),
    "padeos_k3_whiten": (True, STOPS_PADEOS, 16, "k3", True, None),
}
KL_COEF = {"k1": 0.2, "k3": 0.5}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Save the models and tokenizers, run TRL 1.12's side once for every run, load what it recorded."""
    trl_dir = trl112_dir()
    if trl_dir is None:
        pytest.fail(MISSING, pytrace=False)
    tmp = tmp_path_factory.mktemp("trl112_ppo")
    models = build_models()
    model_dirs = {}
    for name, model in models.items():
        model.save_pretrained(tmp / name)
        model_dirs[name] = str(tmp / name)
    for pad_is_eos in (False, True):
        build_tokenizer(pad_is_eos).save_pretrained(tmp / f"tokenizer_pad_is_eos_{pad_is_eos}")

    prompts = make_prompts()
    runs, meta = [], {}
    for name, (pad_is_eos, stops, seed, estimator, whiten, penalty) in RUNS.items():
        pad = EOS if pad_is_eos else PAD
        ppo = dict(
            SETTINGS,
            kl_coef=KL_COEF[estimator],
            kl_estimator=estimator,
            whiten_rewards=whiten,
            missing_eos_penalty=penalty,
        )
        runs.append(
            dict(
                name=name,
                tokenizer_dir=str(tmp / f"tokenizer_pad_is_eos_{pad_is_eos}"),
                prompts=prompts,
                responses=make_responses(stops, pad, seed),
                ppo=ppo,
                seed=seed,
            )
        )
        meta[name] = dict(pad=pad, stops=stops, ppo=ppo)
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"models": model_dirs, "runs": runs, "out_dir": str(tmp / "out")}))

    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        TRL_EXPERIMENTAL_SILENCE="1",
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=os.pathsep.join([str(trl_dir), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(spec)], env=env, cwd=REPO, capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        pytest.fail(
            f"the TRL 1.12 side failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}",
            pytrace=False,
        )
    print(f"\nTRL 1.12 side: {len(runs)} runs in {time.perf_counter() - start:.1f} s")
    results = {}
    for name, run in zip(RUNS, runs):
        tensors = load_file(str(tmp / "out" / f"{name}.safetensors"))
        order = torch.argsort(tensors["prompt_index"])  # TRL's dataloader shuffles: rows in prompt order
        assert torch.equal(tensors["prompt_index"][order], torch.arange(BATCH)), tensors["prompt_index"]
        tensors = {k: v[order] if v.dim() and v.shape[0] == BATCH else v for k, v in tensors.items()}
        assert torch.equal(tensors["frame_responses"], torch.tensor(run["responses"])), name
        results[name] = dict(
            tensors,
            meta=json.loads((tmp / "out" / f"{name}.json").read_text()),
            responses=run["responses"],
            **meta[name],
        )
    return models, results


@pytest.fixture(scope="module", autouse=True)
def report_max_diffs():
    """Print the largest difference reached by each comparison (shown with -s or -rA)."""
    yield
    if not MAX_DIFFS:
        return
    width = max(map(len, MAX_DIFFS))
    lines = [f"  {key:<{width}}  {diff:.3g}" for key, diff in sorted(MAX_DIFFS.items())]
    math = max((d for k, d in MAX_DIFFS.items() if "(model)" not in k), default=0.0)
    model = max((d for k, d in MAX_DIFFS.items() if "(model)" in k), default=0.0)
    print(
        "\nmax abs diff per comparison:\n"
        + "\n".join(lines)
        + f"\n  overall: math on the same inputs {math:.3g}, model outputs (model) {model:.3g}"
    )


# -------------------------------------------------------------------------------------------- our side


def close(name: str, ours: torch.Tensor, theirs: torch.Tensor, atol: float = ATOL_MATH) -> None:
    ours, theirs = ours.double(), theirs.double()
    diff = (ours - theirs).abs().max().item() if ours.numel() else 0.0
    MAX_DIFFS[name] = max(MAX_DIFFS.get(name, 0.0), diff)
    assert ours.shape == theirs.shape, f"{name}: shapes {tuple(ours.shape)} vs {tuple(theirs.shape)}"
    assert diff <= atol, f"{name}: max abs diff {diff:.3g} > {atol:g}\nours:\n{ours}\nTRL 1.12:\n{theirs}"


def our_math(r: dict, logprobs, ref_logprobs, values, scores, mask, last_index):
    """train_ppo's steps 3-4 (rlhf_core/ppo.py), line for line, on the given tensors."""
    ppo = r["ppo"]
    kl = kl_per_token(logprobs, ref_logprobs, ppo["kl_estimator"]) * mask
    rewards, non_score = kl_penalized_rewards(scores, kl, mask, last_index, ppo["kl_coef"])
    raw_rewards = rewards
    if ppo["whiten_rewards"]:
        rewards = masked_whiten(rewards, mask, shift_mean=False) * mask
    advantages, returns = compute_gae(rewards, values * mask, mask, ppo["gamma"], ppo["lam"])
    whitened = masked_whiten(advantages, mask) * mask
    return dict(
        kl=kl,
        non_score=non_score,
        raw_rewards=raw_rewards,
        rewards=rewards,
        raw_advantages=advantages,
        advantages=whitened,
        returns=returns,
    )


def trl_way(r: dict, logprobs, ref_logprobs, values, scores, mask, last_index):
    """Our pieces, composed as TRL 1.12 places the score: on last + 1 (last if that is past the end), with
    the values, the reward whitening and the GAE kept to last + 1, the advantages whitened over `mask`."""
    ppo = r["ppo"]
    width = mask.shape[1]
    end = torch.where(last_index + 1 < width, last_index + 1, last_index)
    mask_p1 = (torch.arange(width).view(1, -1) <= end.view(-1, 1)).long()
    kl = kl_per_token(logprobs, ref_logprobs, ppo["kl_estimator"]) * mask
    rewards, _ = kl_penalized_rewards(scores, kl, mask, end, ppo["kl_coef"])  # the score on `end`, not `last`
    raw_rewards = rewards
    if ppo["whiten_rewards"]:
        rewards = masked_whiten(rewards, mask_p1, shift_mean=False) * mask_p1
    advantages, returns = compute_gae(rewards, values * mask_p1, mask_p1, ppo["gamma"], ppo["lam"])
    whitened = masked_whiten(advantages, mask) * mask
    return dict(
        raw_rewards=raw_rewards,
        rewards=rewards,
        raw_advantages=advantages,
        advantages=whitened,
        returns=returns,
        mask_p1=mask_p1,
        end=end,
    )


def trl_outputs(r: dict) -> dict[str, torch.Tensor]:
    """TRL 1.12's tensors as recorded inside train()."""
    out = dict(
        kl=r["frame_kl"],
        non_score=r["frame_non_score_reward"],
        rewards=r["frame_rewards"],
        raw_advantages=r["whiten_advantages_in"],
        advantages=r["frame_advantages"],
        returns=r["frame_returns"],
    )
    out["raw_rewards"] = r["whiten_rewards_in"] if r["ppo"]["whiten_rewards"] else r["frame_rewards"]
    return out


def inputs(r: dict):
    """The rollout as both sides see it, and our response_mask of it."""
    queries, responses = r["frame_queries"], r["frame_responses"]
    query_mask = (queries != r["pad"]).long()  # prompts hold no pad id; left padding only
    mask, last, has_stop = response_mask(responses, [EOS])
    return queries, query_mask, responses, mask, last, has_stop


# ------------------------------------------------------------------------------------------------ tests


def test_trl_112_is_installed_apart():
    if trl112_dir() is None:
        pytest.fail(MISSING, pytrace=False)


def test_trl_side_is_trl_112(world):
    _, results = world
    for r in results.values():
        meta = r["meta"]
        assert meta["trl_version"] == "1.12.0", meta
        assert "trl-1.12.0" in meta["ppo_trainer_file"], meta
        assert meta["stop_token_id"] == EOS and meta["eos_token_id"] == EOS and meta["pad_token_id"] == r["pad"]
        # TRL divides logits by temperature + 1e-7; our side below uses the same for the log-probabilities
        assert r["generation_temperature"].item() == pytest.approx(SETTINGS["temperature"] + 1e-7, abs=1e-12)
        assert r["frame_responses"].shape == (BATCH, RESPONSE_LENGTH)


@pytest.mark.parametrize("name", [n for n in RUNS if not n.startswith("padeos")])
def test_rollout_inputs_match(world, name):
    """pad != eos: our mask, scores (with missing_eos_penalty), values and log-probabilities are TRL's."""
    models, results = world
    r = results[name]
    queries, query_mask, responses, mask, last, has_stop = inputs(r)
    assert torch.equal(r["frame_postprocessed_responses"], responses)  # responses come padded after the eos
    assert torch.equal(mask.bool(), ~r["frame_padding_mask"]), "our response mask is TRL's ~padding_mask"
    assert torch.equal(last, r["frame_sequence_lengths"]), "our last_index is TRL's sequence_lengths"
    assert torch.equal(has_stop, r["frame_contain_eos_token"])
    expected_stop = torch.tensor([s is not None for s in r["stops"]])
    assert torch.equal(has_stop, expected_stop)
    context = int(r["context_length"])
    assert torch.equal(r["reward_index"] - context, last), "TRL reads the score at the last real token, as we do"

    rollout = Rollout(queries, query_mask, responses, mask, last, None, None, has_stop)
    scores, values = score_rollout(
        rollout, models["value"], models["reward"], missing_eos_penalty=r["ppo"]["missing_eos_penalty"]
    )
    close(f"scores (model) [{name}]", scores, r["frame_scores"], ATOL_MODEL)
    close(f"values on mask (model) [{name}]", values, r["frame_values"] * mask, ATOL_MODEL)
    # TRL keeps one more value, at last + 1: our token_values gives it with the mask extended by one
    width = mask.shape[1]
    mask_p1 = (~r["frame_padding_mask_p1"]).long()
    values_p1 = token_values(models["value"], queries, query_mask, responses, mask_p1)
    close(f"values to last+1 (model) [{name}]", values_p1, r["frame_values"], ATOL_MODEL)
    assert torch.equal(mask_p1.sum(1), torch.clamp(last + 2, max=width))

    temperature = SETTINGS["temperature"] + 1e-7
    for key, model in (("ref_logprobs", models["ref"]), ("logprobs", models["policy"])):
        ours, _ = response_logprobs(model, queries, query_mask, responses, mask, temperature=temperature)
        close(f"{key} (model) [{name}]", ours, r[f"frame_{key}"], ATOL_MODEL)  # INVALID_LOGPROB on padding on both


@pytest.mark.parametrize("name", ["full_k1", "full_k3_whiten"])
def test_full_length_responses_match_trl_exactly(world, name):
    """No response stops: rewards, advantages (raw and whitened) and returns are TRL's."""
    _, results = world
    r = results[name]
    _, _, _, mask, last, has_stop = inputs(r)
    assert not has_stop.any() and bool(mask.all()) and bool((last == RESPONSE_LENGTH - 1).all())
    assert torch.equal(r["frame_actual_end"], last)  # TRL's score column: last + 1 is past the end

    ours = our_math(r, r["frame_logprobs"], r["frame_ref_logprobs"], r["frame_values"], r["frame_scores"], mask, last)
    theirs = trl_outputs(r)
    for key in ("kl", "non_score", "raw_rewards", "rewards", "raw_advantages", "advantages", "returns"):
        close(f"{key} [{name}]", ours[key], theirs[key])
    if r["ppo"]["whiten_rewards"]:
        assert not torch.allclose(ours["rewards"], ours["raw_rewards"])  # whitening did something


@pytest.mark.parametrize("name", ["stop_k1", "stop_k3_whiten"])
def test_early_stop_differs_from_trl_only_by_score_placement(world, name):
    """pad != eos, responses that stop early. Documented difference: our score is on the stop token (the last
    real token, `last`), TRL 1.12's on last + 1 (`actual_end`), with TRL's values, reward whitening and GAE
    running to last + 1 too. TRL's rewards, advantages and returns equal ours composed that way."""
    _, results = world
    r = results[name]
    _, _, _, mask, last, has_stop = inputs(r)
    width = mask.shape[1]
    rows = torch.arange(BATCH)
    logprobs, ref_logprobs, values, scores = (
        r["frame_logprobs"],
        r["frame_ref_logprobs"],
        r["frame_values"],
        r["frame_scores"],
    )
    theirs = trl_outputs(r)

    # 1. the KL part is the same: per-token KL on the real tokens, zero after the stop token
    ours = our_math(r, logprobs, ref_logprobs, values, scores, mask, last)
    close(f"kl [{name}]", ours["kl"], theirs["kl"])
    close(f"non_score [{name}]", ours["non_score"], theirs["non_score"])

    # 2. the score goes to last + 1 in TRL, unless that is past the end (stop on the last position or no stop)
    shifted = last + 1 < width
    assert torch.equal(r["frame_actual_end"], torch.where(shifted, last + 1, last))
    assert shifted.tolist() == [s is not None and s < width - 1 for s in r["stops"]]

    # 3. TRL's result == ours with the score moved to last + 1 and the values kept to last + 1
    moved = trl_way(r, logprobs, ref_logprobs, values, scores, mask, last)
    assert torch.equal(moved["mask_p1"].bool(), ~r["frame_padding_mask_p1"])
    for key in ("raw_rewards", "rewards", "raw_advantages", "advantages", "returns"):
        close(f"{key}, score moved to last+1 [{name}]", moved[key], theirs[key])

    # 4. where and how ours differs: the raw rewards only at (row, last) and (row, last + 1), by the score
    delta = theirs["raw_rewards"] - ours["raw_rewards"]
    expected = torch.zeros_like(delta)
    expected[rows[shifted], last[shifted]] = -scores[shifted]
    expected[rows[shifted], last[shifted] + 1] = scores[shifted]
    close(f"raw reward difference = score moved [{name}]", delta, expected)
    # rows where the score lands on the same token (no stop, or a stop on the last position) agree on the
    # raw advantages and the returns, unless the rewards are whitened (batch statistics mix the rows)
    same = ~shifted
    if not r["ppo"]["whiten_rewards"]:
        close(
            f"raw advantages on unshifted rows [{name}]", ours["raw_advantages"][same], theirs["raw_advantages"][same]
        )
        close(f"returns on unshifted rows [{name}]", ours["returns"][same], theirs["returns"][same])
    # on shifted rows: our advantage at the stop token is r_last + score - V_last; TRL's is
    # r_last + gamma * V_{last+1} - V_last + gamma * lam * A_{last+1} with A_{last+1} = score' - V_{last+1}
    # (score' the whitened reward there with whiten_rewards), and TRL's return at last + 1 is that reward,
    # where ours is 0 (past the response)
    p1 = last[shifted] + 1
    close(
        f"TRL return at last+1 == its reward [{name}]",
        theirs["returns"][rows[shifted], p1],
        theirs["rewards"][rows[shifted], p1],
    )
    assert bool((ours["returns"][rows[shifted], p1] == 0).all())
    assert bool((theirs["advantages"][rows[shifted], p1] == 0).all())  # whitened advantages: both masked there
    assert not torch.allclose(ours["advantages"], theirs["advantages"], atol=1e-3)  # the difference is real


@pytest.mark.parametrize("name", ["padeos_k1", "padeos_k3_whiten"])
def test_pad_equals_eos(world, name):
    """pad == eos (GPT-2, Qwen2.5 base). TRL 1.12 truncates at the eos and then finds the end as the first
    pad token - 1; the eos IS a pad token, so for a response that stopped at s:
      - sequence_lengths = s - 1: the eos is outside TRL's mask (padding_mask): its log-probabilities are
        INVALID_LOGPROB, its KL 0, its advantage 0 -> the policy gradient never trains the stop token;
      - get_reward attends to query_responses != pad, so the reward model never sees the eos, and the score is
        its output at the token before the eos (and a stop at s = 0 would give sequence_lengths = -1: a score
        read at the last prompt token);
      - the score is added at s (= sequence_lengths + 1), on the eos position, where TRL's KL is 0, and the
        values are kept to s (the value of the state before the eos, the same as ours);
      - contain_eos_token is still right (eos in the response).
    Ours: the response ends at its first eos, which is part of it (mask, KL, score on it, has_stop True).
    So TRL here == our pieces composed TRL's way with `last` = s - 1 (as for pad != eos, one token earlier)."""
    models, results = world
    r = results[name]
    queries, query_mask, responses, mask, last, has_stop = inputs(r)
    rows = torch.arange(BATCH)
    stopped = torch.tensor([s is not None for s in r["stops"]])

    # ours keeps the stop token
    assert torch.equal(has_stop, stopped)
    assert bool((responses[rows[stopped], last[stopped]] == EOS).all())
    assert bool((mask[rows[stopped], last[stopped]] == 1).all()), "our mask keeps the stop token"
    assert torch.equal(mask.sum(1), last + 1)
    # TRL's drops it
    trl_last = r["frame_sequence_lengths"]
    assert torch.equal(trl_last, torch.where(stopped, last - 1, last))
    trl_mask = (~r["frame_padding_mask"]).long()
    assert bool((trl_mask[rows[stopped], last[stopped]] == 0).all()), "TRL 1.12's mask drops the eos when pad == eos"
    assert torch.equal(r["frame_contain_eos_token"], has_stop)
    assert torch.equal(r["frame_actual_end"], last)  # TRL's score column: the eos position (s - 1 + 1)
    # ...but the reward model is read one token earlier, at the token before the eos
    assert torch.equal(r["reward_index"] - int(r["context_length"]), trl_last)

    # TRL's score: the reward model at the token before the eos, not attending the eos
    penalty = r["ppo"]["missing_eos_penalty"] or 0.0
    trl_scores_model = sequence_scores(models["reward"], queries, query_mask, responses, trl_mask, trl_last)
    close(
        f"TRL score = reward at last-1 (model) [{name}]",
        trl_scores_model - penalty * (~has_stop).float(),
        r["frame_scores"],
        ATOL_MODEL,
    )
    ours_scores, ours_values = score_rollout(
        Rollout(queries, query_mask, responses, mask, last, None, None, has_stop),
        models["value"],
        models["reward"],
        missing_eos_penalty=r["ppo"]["missing_eos_penalty"],
    )
    close(f"scores of unstopped rows (model) [{name}]", ours_scores[~stopped], r["frame_scores"][~stopped], ATOL_MODEL)
    assert not torch.allclose(ours_scores[stopped], r["frame_scores"][stopped], atol=1e-3)
    # TRL's values are kept to sequence_lengths + 1 = s: exactly our values, on our mask
    close(f"values (model) [{name}]", ours_values, r["frame_values"], ATOL_MODEL)

    # TRL's rewards, advantages and returns == ours composed TRL's way with last = s - 1
    logprobs, ref_logprobs, values, scores = (
        r["frame_logprobs"],
        r["frame_ref_logprobs"],
        r["frame_values"],
        r["frame_scores"],
    )
    theirs = trl_outputs(r)
    moved = trl_way(r, logprobs, ref_logprobs, values, scores, trl_mask, trl_last)
    for key in ("raw_rewards", "rewards", "raw_advantages", "advantages", "returns"):
        close(f"{key}, TRL way with last=s-1 [{name}]", moved[key], theirs[key])
    assert bool((theirs["kl"][rows[stopped], last[stopped]] == 0).all())  # the eos carries no KL in TRL
    assert bool((theirs["advantages"][rows[stopped], last[stopped]] == 0).all())  # nor an advantage

    # ours on the same log-probabilities: the eos has a KL term and an advantage (INVALID_LOGPROB is only on
    # TRL's padding, so ours takes the real log-probabilities of the eos, from our response_logprobs)
    temperature = SETTINGS["temperature"] + 1e-7
    our_lp, _ = response_logprobs(models["policy"], queries, query_mask, responses, mask, temperature=temperature)
    our_ref, _ = response_logprobs(models["ref"], queries, query_mask, responses, mask, temperature=temperature)
    close(f"logprobs on TRL's mask (model) [{name}]", our_lp * trl_mask, logprobs * trl_mask, ATOL_MODEL)
    close(f"ref_logprobs on TRL's mask (model) [{name}]", our_ref * trl_mask, ref_logprobs * trl_mask, ATOL_MODEL)
    ours = our_math(r, our_lp, our_ref, ours_values, ours_scores, mask, last)
    assert bool((ours["kl"][rows[stopped], last[stopped]] != 0).all())
    assert bool((ours["advantages"][rows[stopped], last[stopped]] != 0).all())


def prompt_text(ids: list[int]) -> str:
    return " ".join("<bos>" if t == BOS else f"w{t}" for t in ids)


@pytest.mark.parametrize("name", list(RUNS))
def test_train_ppo_end_to_end(world, name, monkeypatch, tmp_path):
    """Our real `train_ppo`, one iteration on copies of the same models, with the same prompts and responses:
    only `rlhf_core.rollout.generate` is replaced (it returns each prompt's fixed response, padded with the
    loop's pad id); collect_rollout, score_rollout, the KL, rewards, GAE and whitening are ours, recorded
    through wrappers that call the originals. The temperature is TRL's, 0.7 + 1e-7."""
    import copy

    import rlhf_core.ppo as ppo_module
    import rlhf_core.rollout as rollout_module
    from rlhf_core.config import PPOConfig, RLConfig, RunConfig
    from rlhf_core.ppo import train_ppo

    models, results = world
    r = results[name]
    ppo = r["ppo"]
    prompts = make_prompts()
    by_prompt = {tuple(p): i for i, p in enumerate(prompts)}
    fixed = torch.tensor(r["responses"])  # row i: the response of prompt i
    seen, rec = {}, {}

    def generate(policy, query_ids, query_mask, settings, *, pad_token_id, stop_token_ids=(), prompt_repeats=1):
        rows = [by_prompt[tuple(q[m.bool()].tolist())] for q, m in zip(query_ids.cpu(), query_mask.cpu())]
        seen.update(pad=pad_token_id, stops=tuple(stop_token_ids), temperature=settings.temperature, rows=rows)
        return fixed[rows].to(query_ids.device)

    def recording(fn, record):
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            record(out, *args, **kwargs)
            return out

        return wrapper

    def on_whiten(out, x, mask, shift_mean=True, all_reduce=None):
        rec["whitened_advantages" if shift_mean else "whitened_rewards"] = out * mask

    monkeypatch.setattr(rollout_module, "generate", generate)
    monkeypatch.setattr(
        ppo_module,
        "collect_rollout",
        recording(ppo_module.collect_rollout, lambda out, *a, **k: rec.update(rollout=out)),
    )
    monkeypatch.setattr(
        ppo_module,
        "score_rollout",
        recording(ppo_module.score_rollout, lambda out, *a, **k: rec.update(scores=out[0], values=out[1])),
    )
    monkeypatch.setattr(
        ppo_module,
        "kl_penalized_rewards",
        recording(
            ppo_module.kl_penalized_rewards,
            lambda out, scores, kl, mask, last, coef: rec.update(
                kl=kl, raw_rewards=out[0], non_score=out[1], kl_coef=coef
            ),
        ),
    )
    monkeypatch.setattr(
        ppo_module,
        "compute_gae",
        recording(
            ppo_module.compute_gae,
            lambda out, rewards, values, mask, gamma, lam: rec.update(
                gae_rewards=rewards, raw_advantages=out[0], returns=out[1], gae=(gamma, lam)
            ),
        ),
    )
    monkeypatch.setattr(ppo_module, "masked_whiten", recording(ppo_module.masked_whiten, on_whiten))

    rl = RLConfig(
        total_steps=1,
        batch_size=BATCH,
        response_length=RESPONSE_LENGTH,
        learning_rate=1e-3,
        temperature=ppo["temperature"] + 1e-7,
        stop_token="eos",
        missing_eos_penalty=ppo["missing_eos_penalty"],
        save_steps=100,
        log_steps=1,
    )
    ppo_cfg = PPOConfig(
        kl_coef=ppo["kl_coef"],
        kl_estimator=ppo["kl_estimator"],
        gamma=ppo["gamma"],
        lam=ppo["lam"],
        whiten_rewards=ppo["whiten_rewards"],
        num_ppo_epochs=1,
        num_mini_batches=1,
    )
    train_ppo(
        copy.deepcopy(models["policy"]),
        copy.deepcopy(models["value"]),
        copy.deepcopy(models["ref"]),
        copy.deepcopy(models["reward"]),
        build_tokenizer(r["pad"] == EOS),
        [prompt_text(p) for p in prompts],
        rl,
        ppo_cfg,
        RunConfig(device="cpu", seed=0),
        max_prompt_length=16,
        output_dir=tmp_path / "ppo",
        show_progress=False,
    )

    assert seen["pad"] == r["pad"] and seen["stops"] == (EOS,), seen
    assert rec["kl_coef"] == ppo["kl_coef"] and rec["gae"] == (ppo["gamma"], ppo["lam"])
    order = torch.argsort(torch.tensor(seen["rows"]))  # our loop's rows -> prompt order
    rollout = rec["rollout"]
    assert torch.equal(rollout.responses[order], r["frame_responses"])
    mask, last, has_stop = rollout.resp_mask[order], rollout.last_index[order], rollout.has_stop[order]
    assert torch.equal(has_stop, torch.tensor([s is not None for s in r["stops"]]))
    assert torch.equal(last, torch.tensor([RESPONSE_LENGTH - 1 if s is None else s for s in r["stops"]]))
    assert torch.equal(mask.sum(1), last + 1)  # the stop token is in our mask, pad == eos or not
    got = {
        k: rec[k][order]
        for k in (
            "scores",
            "values",
            "kl",
            "non_score",
            "raw_rewards",
            "gae_rewards",
            "raw_advantages",
            "whitened_advantages",
            "returns",
        )
    }
    logprobs, ref_logprobs = rollout.logprobs[order], rollout.ref_logprobs[order]
    assert ("whitened_rewards" in rec) == ppo["whiten_rewards"]

    # what train_ppo computed is our_math of its own inputs (and so the pieces the tests above pin to TRL)
    expected = our_math(r, logprobs, ref_logprobs, got["values"], got["scores"], mask, last)
    for ours_key, key in (
        ("kl", "kl"),
        ("non_score", "non_score"),
        ("raw_rewards", "raw_rewards"),
        ("gae_rewards", "rewards"),
        ("raw_advantages", "raw_advantages"),
        ("whitened_advantages", "advantages"),
        ("returns", "returns"),
    ):
        close(f"train_ppo {ours_key} == our_math [{name}]", got[ours_key], expected[key])

    # its inputs are TRL's: log-probabilities on the tokens both count, scores and values where they agree
    trl_mask = (~r["frame_padding_mask"]).long()
    close(f"train_ppo logprobs (model) [{name}]", logprobs * trl_mask, r["frame_logprobs"] * trl_mask, ATOL_MODEL)
    close(
        f"train_ppo ref_logprobs (model) [{name}]",
        ref_logprobs * trl_mask,
        r["frame_ref_logprobs"] * trl_mask,
        ATOL_MODEL,
    )
    close(f"train_ppo values (model) [{name}]", got["values"], r["frame_values"] * mask, ATOL_MODEL)
    agree = ~has_stop if name.startswith("padeos") else torch.ones(BATCH, dtype=torch.bool)
    close(f"train_ppo scores (model) [{name}]", got["scores"][agree], r["frame_scores"][agree], ATOL_MODEL)

    if name.startswith("full"):  # nothing stops: train_ppo's tensors are TRL's
        theirs = trl_outputs(r)
        for ours_key, key in (
            ("kl", "kl"),
            ("non_score", "non_score"),
            ("raw_rewards", "raw_rewards"),
            ("gae_rewards", "rewards"),
            ("raw_advantages", "raw_advantages"),
            ("whitened_advantages", "advantages"),
            ("returns", "returns"),
        ):
            close(f"train_ppo {ours_key} == TRL (model) [{name}]", got[ours_key], theirs[key], ATOL_MODEL)
    elif name.startswith("stop"):  # TRL's == train_ppo's inputs composed TRL's way (score on last + 1)
        moved = trl_way(r, logprobs, ref_logprobs, r["frame_values"], got["scores"], mask, last)
        for key in ("rewards", "raw_advantages", "advantages", "returns"):
            close(f"train_ppo inputs, TRL way: {key} (model) [{name}]", moved[key], trl_outputs(r)[key], ATOL_MODEL)
    else:  # pad == eos: our stop token carries its KL and is trained (TRL drops it)
        rows = torch.arange(BATCH)[has_stop]
        assert bool((got["kl"][rows, last[has_stop]] != 0).all())
        assert bool((got["whitened_advantages"][rows, last[has_stop]] != 0).all())
