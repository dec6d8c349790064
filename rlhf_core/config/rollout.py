"""The rollout engine section: which engine samples the RL stage's rollouts (`hf`, our decode loop, or `vllm`, a
server apart), the vLLM server's settings, and the correction between the behaviour policy's numbers (the engine's,
or an older policy version's when generation runs ahead) and the trainer's (docs/rollout-engines.md)."""

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
        description="The server's weights and activations: float32 on a CPU (here); bfloat16 on a GPU, where the correction (rollout.correction) absorbs the gap to the trainer.",
    )
    sync_every_steps: int = Field(
        1,
        ge=1,
        description="RL steps between weight pushes to the server (the policy after the step's optimizer steps, LoRA merged, as safetensors in the stage's engine-weights/); between pushes the server samples from older weights and the correction (rollout.correction) weighs what that costs.",
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


class CorrectionConfig(Section):
    """The truncated importance sampling between the behaviour policy and the trainer, for either engine."""

    mode: CorrectionName = Field(
        "sequence_mask",
        description="Truncated importance sampling between the behaviour policy's log-probs and the trainer's, wherever they differ: the behaviour policy is the engine's (rollout.engine vllm), or the policy version a rollout sampled ahead was drawn from (rollout.max_staleness > 0, either engine). token_truncate, token_mask, sequence_truncate, sequence_mask (the default, as TRL's vllm_importance_sampling_mode), or none (the gap is logged, the loss left as it is). Unused by hf in step (the trainer samples itself).",
    )
    cap: float | None = Field(
        3.0,
        gt=0.0,
        description="The ratio's upper bound: truncated above it (the *_truncate modes) or masked (the *_mask modes); TRL's vllm_importance_sampling_cap. null: none.",
    )
    min: float | None = Field(
        None, ge=0.0, description="The ratio's lower bound (the same way); null: none (TRL's default)."
    )


class RolloutConfig(Section):
    engine: Literal["hf", "vllm"] = Field(
        "hf",
        description="What samples the RL stage's rollouts: hf (our decode loop in the trainer's process, the default) or vllm (a vLLM server apart, rollout.vllm.*).",
    )
    vllm: VllmSettings = Field(default_factory=VllmSettings, description="The vLLM engine (rollout.engine vllm).")
    correction: CorrectionConfig = Field(
        default_factory=CorrectionConfig,
        description="The correction of the loss for a behaviour policy apart from the trainer's: the engine's, or an older policy version's (generation ahead).",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="How many policy versions generation may run ahead of training (TRL's max_staleness, verl's staleness_threshold): with k > 0 the rollouts of steps t+1..t+k are sampled while step t trains, on a generator apart (vllm: its server, fed from a thread; hf: a process holding its own copy of the policy), and a batch sampled from weights more than k versions older than the step that trains on it is dropped and sampled again; the loss carries the correction rollout.correction names. 0: each step samples with the weights it trains (the default). The GRPO family, one process (docs/async-rollouts.md).",
    )

    @property
    def off_policy(self) -> bool:
        """A behaviour policy apart from the trainer's: an engine of its own (vllm), or generation ahead."""
        return self.engine == "vllm" or self.max_staleness > 0

    def result_fields(self) -> dict:
        """What changes the stage's weights or evaluations (the RL stage's key): nothing for hf in step (older keys
        stay), else the engine, its precision, push cadence, correction, evaluation and staleness, never where the
        server runs."""
        if not self.off_policy:
            return {}
        v, c = self.vllm, self.correction
        fields = {"engine": self.engine, "correction": [c.mode, c.cap, c.min]}
        if self.engine == "vllm":
            fields |= {"dtype": v.dtype, "sync_every_steps": v.sync_every_steps, "evaluate": v.evaluate}
        if self.max_staleness:
            fields["max_staleness"] = self.max_staleness
        return fields
