"""The engine correction against TRL 1.16's own: `GRPOTrainer._generate_and_score_completions` run for real with
`use_vllm` and `vllm_importance_sampling_correction` on, on fixed completions that come with fixed generator
log-probs (vLLM's, with one it could not score), as tests/parity/trl_grpo_common.py drives it. TRL recomputes the
old log-probs with its model; `engine_correction` gets those and the same generator log-probs. Compared: TRL's
`importance_sampling_ratio` output and the sampling/* statistics it logs, for every mode, with and without a lower
cap. Tolerance: atol 1e-6, rtol 1e-5 (float32)."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.rl.engine_correction import engine_correction
from tests.parity.trl_grpo_common import NAN, TOL, drive_trl_scoring, fake_completions

CASES = [
    ("token_truncate", None, 3.0),
    ("token_truncate", 0.8, 1.1),
    ("token_mask", 0.9, 1.1),
    ("sequence_truncate", None, 3.0),
    ("sequence_mask", None, 3.0),  # TRL's default
    ("sequence_mask", 0.5, 1.5),
]


def generator_logps(completions: list[list[int]], seed: int = 0) -> list[list[float]]:
    """Log-probs a generator might report: about ln(1/64) per token (the tiny model's vocabulary is 64, its
    log-probs near uniform), spread enough that the caps bite; one unknown (NaN)."""
    generator = torch.Generator().manual_seed(seed)
    out = [(-4.16 + 0.7 * torch.randn(len(c), generator=generator)).tolist() for c in completions]
    out[1][0] = NAN
    return out


@pytest.mark.parametrize(("mode", "cap_min", "cap_max"), CASES)
def test_the_engine_correction_is_trls(make_trainer, mode, cap_min, cap_max):
    trainer = make_trainer(temperature=0.7)
    trainer.use_vllm = True
    trainer.vllm_importance_sampling_correction = True
    trainer.vllm_importance_sampling_mode = mode
    trainer.vllm_importance_sampling_clip_min = cap_min
    trainer.vllm_importance_sampling_clip_max = cap_max
    completions = fake_completions(8)
    sampled = generator_logps(completions)
    out = drive_trl_scoring(trainer, torch.arange(8.0).unsqueeze(1), completions=completions, sampling_logps=sampled)

    ours = engine_correction(
        out["old_per_token_logps"],
        out["sampling_per_token_logps"],
        out["completion_mask"],
        mode,
        cap_max=cap_max,
        cap_min=cap_min,
    )
    torch.testing.assert_close(ours.weights, out["importance_sampling_ratio"], **TOL)
    logged = trainer._metrics["train"]
    for name, value in ours.metrics.items():
        assert value.item() == pytest.approx(logged[name][-1], rel=1e-5, abs=1e-6), name
    # not a trivial comparison: the caps changed some weights, and the weights are not all one
    raw = torch.exp(
        (out["old_per_token_logps"] - out["sampling_per_token_logps"]).nan_to_num() * out["completion_mask"]
    )
    assert (ours.weights != 1).any()
    if mode.startswith("token"):
        assert not torch.allclose(ours.weights, raw)
