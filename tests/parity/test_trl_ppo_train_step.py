"""PPO parity with TRL 1.12: one iteration of our real `train_ppo` (setup in tests/parity/trl_ppo_common.py).

Same models, prompts and responses as TRL's side, only generation replaced: what `train_ppo` computes is
`our_math` of its own inputs, its inputs are TRL's, and for responses that never stop its KL, rewards,
advantages and returns are TRL's tensors themselves.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_core.rl.inputs import rl_inputs
from tests.parity.trl_ppo_common import (
    ATOL_MODEL,
    BATCH,
    BOS,
    EOS,
    RESPONSE_LENGTH,
    RUNS,
    build_tokenizer,
    close,
    make_prompts,
    our_math,
    trl_outputs,
    trl_way,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("report_max_diffs")]  # TRL 1.12 runs in a process of its own


def prompt_text(ids: list[int]) -> str:
    return " ".join("<bos>" if t == BOS else f"w{t}" for t in ids)


@pytest.mark.parametrize("name", list(RUNS))
def test_train_ppo_end_to_end(world, name, monkeypatch, tmp_path):
    """Our real `train_ppo`, one iteration on copies of the same models, with the same prompts and responses:
    only `rlhf_core.rollout.engines.generate` (our loop engine's) is replaced (it returns each prompt's fixed
    response, padded with the loop's pad id); score_sampled, score_rollout, the KL, rewards, GAE and whitening are ours, recorded
    through wrappers that call the originals. The temperature is TRL's, 0.7 + 1e-7."""
    import copy

    import rlhf_core.rl.advantages.estimators as advantages_module
    import rlhf_core.rl.ppo as ppo_module
    import rlhf_core.rollout.engines as rollout_module
    from rlhf_core.config import PPOConfig, RLConfig, RunConfig
    from rlhf_core.rl.ppo import train_ppo

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
        "score_sampled",
        recording(ppo_module.score_sampled, lambda out, *a, **k: rec.update(rollout=out)),
    )
    monkeypatch.setattr(
        ppo_module,
        "score_rollout",
        recording(ppo_module.score_rollout, lambda out, *a, **k: rec.update(scores=out[0], values=out[1])),
    )
    monkeypatch.setattr(
        advantages_module,
        "kl_penalized_rewards",
        recording(
            advantages_module.kl_penalized_rewards,
            lambda out, scores, kl, mask, last, coef: rec.update(
                kl=kl, raw_rewards=out[0], non_score=out[1], kl_coef=coef
            ),
        ),
    )
    monkeypatch.setattr(
        advantages_module,
        "compute_gae",
        recording(
            advantages_module.compute_gae,
            lambda out, rewards, values, mask, gamma, lam: rec.update(
                gae_rewards=rewards, raw_advantages=out[0], returns=out[1], gae=(gamma, lam)
            ),
        ),
    )
    monkeypatch.setattr(advantages_module, "masked_whiten", recording(advantages_module.masked_whiten, on_whiten))

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
        rl_inputs(
            copy.deepcopy(models["policy"]),
            build_tokenizer(r["pad"] == EOS),
            [prompt_text(p) for p in prompts],
            tmp_path / "ppo",
            value=copy.deepcopy(models["value"]),
            reference=copy.deepcopy(models["ref"]),
            reward_model=copy.deepcopy(models["reward"]),
            rl=rl,
            ppo=ppo_cfg,
            run=RunConfig(device="cpu", seed=0),
            max_prompt_length=16,
            show_progress=False,
        )
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
