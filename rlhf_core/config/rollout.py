"""The rollout engine section: which engine samples the RL stage's rollouts (`hf`, our decode loop, or `vllm`, a
server apart), the vLLM server's settings, and the correction between the engine's numbers and the trainer's
(docs/rollout-engines.md)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field

from rlhf_core.config.base import ExpandedPath, Section

REPOSITORY = Path(__file__).resolve().parents[2]
VLLM_PYTHON_ENV = "RLHF_VLLM_PYTHON"  # where the vLLM environment's interpreter is, when rollout.vllm.python is null

CorrectionName = Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


class VllmSettings(Section):
    url: str | None = Field(
        None,
        description="A vLLM server already running (http://host:port), started by you with this pipeline's worker extension (docs/rollout-engines.md); null: the RL stage starts one from rollout.vllm.python and stops it when the stage ends.",
    )
    python: ExpandedPath | None = Field(
        None,
        strict=False,
        description=f"The interpreter of the vLLM environment that starts the server; null: ${VLLM_PYTHON_ENV}, else .venv-vllm/bin/python of this repository (`make vllm-venv`).",
    )
    host: str = Field("127.0.0.1", min_length=1, description="The address the started server listens on.")
    port: int | None = Field(None, ge=1, le=65535, description="The started server's port; null: a free one.")
    startup_timeout_s: float = Field(
        300.0, gt=0.0, description="Seconds the started server has to become healthy before the stage fails."
    )
    kv_cache_gib: int = Field(
        1, ge=1, description="GiB of KV cache of vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE); on a GPU, vLLM's own."
    )
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32",
        description="The server's weights and activations: float32 on a CPU (here); bfloat16 on a GPU, where the correction below absorbs the gap to the trainer.",
    )
    sync_every_steps: int = Field(
        1,
        ge=1,
        description="RL steps between weight pushes to the server (the policy after the step's optimizer steps, LoRA merged, as safetensors in the stage's engine-weights/); between pushes the server samples from older weights and the correction weighs what that costs.",
    )
    correction: CorrectionName = Field(
        "sequence_mask",
        description="Truncated importance sampling between the engine's log-probs (the behaviour policy) and the trainer's (TRL's vllm_importance_sampling_mode): token_truncate, token_mask, sequence_truncate, sequence_mask (the default, as TRL), or none.",
    )
    correction_cap: float | None = Field(
        3.0,
        gt=0.0,
        description="The ratio's upper bound: truncated above it (the *_truncate modes) or masked (the *_mask modes); TRL's vllm_importance_sampling_cap. null: none.",
    )
    correction_min: float | None = Field(
        None, ge=0.0, description="The ratio's lower bound (the same way); null: none (TRL's default)."
    )
    evaluate: bool = Field(
        False,
        description="Sample the held-out evaluations on the engine too: the RL stage's (the current policy pushed first) and promotion's (a server started for the version), seeded alike, so promotion repeats the stage's numbers for the same checkpoint; false: our decode loop.",
    )

    def interpreter(self) -> Path:
        """rollout.vllm.python, else $RLHF_VLLM_PYTHON, else this repository's .venv-vllm."""
        if self.python is not None:
            return self.python
        env = os.environ.get(VLLM_PYTHON_ENV)
        return Path(env) if env else REPOSITORY / ".venv-vllm" / "bin" / "python"


class RolloutConfig(Section):
    engine: Literal["hf", "vllm"] = Field(
        "hf",
        description="What samples the RL stage's rollouts: hf (our decode loop in the trainer's process, the default) or vllm (a vLLM server apart, rollout.vllm.*).",
    )
    vllm: VllmSettings = Field(default_factory=VllmSettings, description="The vLLM engine (rollout.engine vllm).")

    def result_fields(self) -> dict:
        """What changes the stage's weights or evaluations (the RL stage's key): nothing for hf (older keys stay),
        else the engine, its precision, push cadence, correction and evaluation, never where the server runs."""
        if self.engine == "hf":
            return {}
        v = self.vllm
        return {
            "engine": self.engine,
            "dtype": v.dtype,
            "sync_every_steps": v.sync_every_steps,
            "correction": [v.correction, v.correction_cap, v.correction_min],
            "evaluate": v.evaluate,
        }
