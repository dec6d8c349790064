"""PPO parity with TRL 1.12: the rollout both sides start from (setup in tests/parity/trl_ppo_common.py).

TRL 1.12 is installed apart and is the version that ran; for pad != eos our response mask, last index and
has-stop flags are TRL's padding mask, sequence lengths and contain_eos_token, and our scores (with
missing_eos_penalty), values (also to last + 1, as TRL keeps them) and log-probabilities of the policy and the
reference are TRL's, on the same tiny models (atol 1e-5).
"""

from __future__ import annotations

import pytest
import torch

from rlhf_core.models.forward import response_logprobs, token_values
from rlhf_core.rl.ppo import score_rollout
from rlhf_core.rollout.collect import Rollout
from tests.parity.trl_ppo_common import (
    ATOL_MODEL,
    BATCH,
    EOS,
    MISSING,
    RESPONSE_LENGTH,
    RUNS,
    SETTINGS,
    close,
    inputs,
    trl112_dir,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("report_max_diffs")]  # TRL 1.12 runs in a process of its own


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
