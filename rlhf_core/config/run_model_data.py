"""The sections that say what runs on what: the run itself, the model, the data (and the demo world's sizes); and
`accelerate_strategy`, what the accelerate launch file that `run.accelerate_config` names asks for."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from rlhf_core.config.base import DEMO, ExpandedPath, PathText, Section


class RunConfig(Section):
    name: str = Field(
        "rlhf", min_length=1, description="Name of the pipeline run, used for the MLflow run and Prefect artifacts."
    )
    output_dir: ExpandedPath = Field(
        Path("outputs/rlhf"),
        strict=False,
        description="Directory for the demo world, checkpoints and exports of this run.",
    )
    seed: int = Field(42, ge=0, description="Seed for data generation, model initialization, shuffling and sampling.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where training runs: auto picks CUDA when available."
    )
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="Torch's intra-op threads in this process; null: torch's default (one per core). Tiny models (the demo's, configs/rlvr.yaml) train fastest on 1, and on a busy machine more threads than free cores can be many times slower.",
    )
    mixed_precision: Literal["no", "fp16", "bf16"] = Field(
        "no", description="Accelerate mixed precision for training loops."
    )
    num_processes: int = Field(
        1,
        ge=1,
        description="Data-parallel processes for the reward, PPO and GRPO stages; >1 launches them as run.launcher says.",
    )
    launcher: Literal["local", "ray"] = Field(
        "local",
        description="How the reward, PPO and GRPO stages start their processes: 'local' runs torchrun (CPU, gloo) or accelerate launch (CUDA) on this machine when num_processes > 1; 'ray' runs them as a Ray Train TorchTrainer of num_processes workers, on the nodes of a Ray cluster.",
    )
    ray_address: str | None = Field(
        None,
        description="With launcher 'ray': null starts a private local Ray instance for each stage that launches and stops it after the stage; 'auto' (RAY_ADDRESS when set, else the cluster this machine runs a node of) or 'host:port' joins an existing cluster (its nodes must share run.output_dir). Where another Ray runs on the machine, set RAY_ADDRESS or host:port (docs/ray.md).",
    )
    ray_cpus_per_worker: float = Field(
        1.0,
        gt=0,
        description="With launcher 'ray': CPUs reserved for each training worker (plus one GPU when run.device is cuda).",
    )
    ray_placement_strategy: Literal["SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK"] = Field(
        "SPREAD",
        description="With launcher 'ray': how the workers are placed on the cluster's nodes (Ray placement group strategy).",
    )
    max_failures: int = Field(
        0,
        ge=0,
        description="Restarts of a stage's processes after one of them dies (Ray Train's FailureConfig.max_failures; torchrun's --max-restarts with launcher 'local'); each restart resumes from the stage's newest complete checkpoint.",
    )
    accelerate_config: ExpandedPath | None = Field(
        None, strict=False, description="accelerate launch config file (DeepSpeed, FSDP) for num_processes > 1 on CUDA."
    )
    keep_last_checkpoints: int | None = Field(
        None,
        ge=1,
        description="Local checkpoints kept per reward, PPO and GRPO stage: the newest N plus the best (reward: highest eval_accuracy; PPO: highest objective/scores, GRPO: highest reward, both the training metrics of the checkpoint's step); null keeps all.",
    )
    memory_budget_gib: float | None = Field(
        None,
        ge=0,
        description="GiB of memory one device (one process's GPU; on CPU, one process) may take: `rlhf validate` and `rlhf run` refuse a config whose estimated peak (the largest stage's, which `rlhf validate` prints part by part: weights, optimizer state, activations, logits, KV cache) exceeds it, before anything trains; null: no check.",
    )


class DemoModelConfig(Section):
    hidden_size: int = Field(128, ge=8, description="Hidden size of the demo's tiny Llama.")
    num_hidden_layers: int = Field(2, ge=1, description="Number of transformer layers of the demo's tiny Llama.")
    num_attention_heads: int = Field(4, ge=1, description="Attention heads of the demo's tiny Llama.")
    intermediate_size: int = Field(256, ge=8, description="MLP width of the demo's tiny Llama.")
    max_position_embeddings: int = Field(128, ge=16, description="Longest sequence the demo's tiny Llama accepts.")

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> DemoModelConfig:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be divisible by num_attention_heads {self.num_attention_heads}"
            )
        return self


class LoraSettings(Section):
    enabled: bool = Field(False, description="Train LoRA adapters through PEFT instead of all weights.")
    r: int = Field(8, ge=1, description="LoRA rank.")
    alpha: int = Field(16, ge=1, description="LoRA scaling numerator (lora_alpha).")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="Dropout on the LoRA branch.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "v_proj"], min_length=1, description="Module names that get adapters."
    )


class ModelConfig(Section):
    base: PathText = Field(
        DEMO,
        min_length=1,
        description="Base policy: 'demo' (built offline), a local directory, a hub name or a models:/ URI.",
    )
    tokenizer: PathText | None = Field(
        None, description="Tokenizer source when it differs from `base`; defaults to the base's own."
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) for hub names.")
    trust_remote_code: bool = Field(
        False, description="Allow model code from the hub to run; only for sources you trust."
    )
    torch_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", description="Dtype the weights are loaded in."
    )
    chat_template: PathText | None = Field(
        None,
        description="Chat template (a Jinja file path or the template itself) for conversational data when the tokenizer has none.",
    )
    gradient_checkpointing: bool | None = Field(
        None,
        description="Recompute each layer's activations in backward instead of keeping them (less memory, about a third more compute); unset: on for every model but the demo's tiny one (TRL's default is on).",
    )
    lora: LoraSettings = Field(
        default_factory=LoraSettings, description="LoRA adapter settings shared by the trained models."
    )
    demo: DemoModelConfig = Field(
        default_factory=DemoModelConfig, description="Architecture of the demo's tiny Llama (used when base is 'demo')."
    )

    @property
    def checkpointing(self) -> bool:
        """Whether the trained models recompute activations: model.gradient_checkpointing, or when unset every
        model but the demo's."""
        if self.gradient_checkpointing is not None:
            return self.gradient_checkpointing
        return str(self.base) != DEMO


class ColumnMap(Section):
    prompt: str = Field("prompt", min_length=1, description="Source column holding the prompt.")
    chosen: str = Field("chosen", min_length=1, description="Source column holding the preferred completion.")
    rejected: str = Field("rejected", min_length=1, description="Source column holding the dispreferred completion.")
    margin: str | None = Field(None, description="Optional source column with a per-pair Bradley-Terry margin.")
    text: str = Field("text", min_length=1, description="Source column holding plain text (SFT corpora).")
    completion: str = Field(
        "completion", min_length=1, description="Source column holding the completion of prompt-completion SFT data."
    )
    messages: str = Field(
        "messages", min_length=1, description="Source column holding a whole conversation (conversational SFT data)."
    )


FEEDBACK_SOURCE = "traces:"  # data.<table>.path: traces:<experiment>, the users' feedback in that MLflow experiment
SINCE_CHOICES = ("all", "last_training")


class DatasetSpec(Section):
    path: PathText = Field(
        DEMO,
        min_length=1,
        description="'demo', a local json/jsonl/parquet/csv file, directory or glob (data/prefs/*.jsonl), a save_to_disk directory, a hub dataset name, or `traces:<experiment>`: the feedback on a served policy's answers traced in that MLflow experiment (docs/feedback.md; preference and prompt tables; its split 'test' is a fixed fifth of the prompts, 'train' the rest).",
    )
    since: str = Field(
        "all",
        description="A `traces:` source's window: 'all' feedback, 'last_training' (what arrived after the cut-off of the newest policy version trained on this source, kept in its `feedback_until` tag), or an ISO 8601 time such as 2026-11-28T00:00:00Z.",
    )
    split: str = Field("train", min_length=1, description="Split to read (local files are one 'train' split).")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of a hub dataset.")
    format: Literal["auto", "standard", "conversational"] = Field(
        "auto",
        description="TRL dataset format: 'auto' detects it from the first row as TRL does; conversational rows go through the chat template.",
    )
    columns: ColumnMap = Field(
        default_factory=ColumnMap, description="Mapping from the pipeline's column names to the source's."
    )
    limit: int | None = Field(None, ge=1, description="Read at most this many rows, in file order.")

    @field_validator("since", mode="before")
    @classmethod
    def _since_text(cls, value: Any) -> Any:
        """A time YAML read as a datetime (2026-11-28T00:00:00Z unquoted), as its ISO text."""
        return value.isoformat() if hasattr(value, "isoformat") else value

    @property
    def feedback_experiment(self) -> str | None:
        """The MLflow experiment of a `traces:` source, else None."""
        return self.path[len(FEEDBACK_SOURCE) :] if self.path.startswith(FEEDBACK_SOURCE) else None

    def since_ms(self) -> int | None:
        """`since` as epoch milliseconds when it is a time; None for 'all' and 'last_training'."""
        if self.since in SINCE_CHOICES:
            return None
        from datetime import UTC, datetime

        moment = datetime.fromisoformat(self.since.replace("Z", "+00:00"))
        return int((moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp() * 1000)

    @model_validator(mode="after")
    def _feedback_source(self) -> DatasetSpec:
        if self.path.startswith(FEEDBACK_SOURCE) and not self.feedback_experiment.strip():
            raise ValueError(f"path '{self.path}' names no experiment: write traces:<MLflow experiment name>")
        if self.feedback_experiment is not None and self.split not in ("train", "test"):
            raise ValueError(
                f"split '{self.split}': a traces: source's splits are 'train' and 'test' (a fixed fifth of the prompts)"
            )
        if self.since != "all" and self.feedback_experiment is None:
            raise ValueError(f"since applies to a traces:<experiment> source, not to '{self.path}'")
        if self.since not in SINCE_CHOICES:
            try:
                self.since_ms()
            except ValueError:
                raise ValueError(
                    f"since '{self.since}' is neither 'all', 'last_training' nor an ISO 8601 time such as "
                    "2026-11-28T00:00:00Z"
                ) from None
        return self

    @model_validator(mode="after")
    def _demo_splits(self) -> DatasetSpec:
        if self.path == DEMO and self.split not in ("train", "test"):
            raise ValueError(
                f"split '{self.split}' does not exist in the demo world; allowed values are 'train' or 'test'"
            )
        return self


class DemoWorldConfig(Section):
    world: Literal["reviews", "arithmetic", "calculator"] = Field(
        "reviews",
        description="reviews: finish a review, VADER labels preferences (the RLHF demo); arithmetic: 'a+b=' problems checked by exact match (the RLVR showcase, configs/rlvr.yaml; no preference data); calculator: three-digit multiplications 'a*b=' and a multiply tool (the tool showcase, configs/tools.yaml).",
    )
    tool_call_fraction: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="calculator: the share of SFT problems solved by calling the tool (the others answered directly).",
    )
    num_sentences: int = Field(6000, ge=10, description="Sentences in the demo's review corpus (SFT data).")
    num_labelled: int = Field(
        800,
        ge=2,
        description="arithmetic and calculator: labelled problems of the SFT corpus (the RL prompts have no answers).",
    )
    num_preference_pairs: int = Field(3000, ge=10, description="Preference pairs labelled by VADER (train split).")
    num_eval_preference_pairs: int = Field(
        400, ge=2, description="Held-out preference pairs (reward-model evaluation)."
    )
    num_train_prompts: int = Field(
        1024,
        ge=2,
        description="Prompts for RL training (arithmetic: without answers to learn from, only the checker's).",
    )
    num_eval_prompts: int = Field(
        64,
        ge=2,
        description="Held-out prompts for generation evaluation (arithmetic: problems in neither training set).",
    )
    min_compound_gap: float = Field(
        0.3, gt=0.0, le=2.0, description="Least VADER compound difference between chosen and rejected."
    )

    def prompt_rows(self, spec: DatasetSpec) -> tuple[int, str]:
        """(the most prompts the demo world's `spec.split` holds, after `spec.limit`; the field that says so): its
        writer may make fewer distinct ones, but never more, so a batch larger than this is refused before the
        world is built."""
        field = "data.demo.num_train_prompts" if spec.split == "train" else "data.demo.num_eval_prompts"
        rows = getattr(self, field.rsplit(".", 1)[1])
        return (rows, field) if spec.limit is None or spec.limit >= rows else (spec.limit, f"{field} and its limit")


class DataConfig(Section):
    preference: DatasetSpec = Field(
        default_factory=DatasetSpec, description="Preference pairs for reward-model training."
    )
    preference_eval: DatasetSpec = Field(
        default_factory=lambda: DatasetSpec(split="test"),
        description="Held-out preference pairs for reward-model evaluation.",
    )
    prompts: DatasetSpec = Field(default_factory=DatasetSpec, description="Prompts for RL rollouts.")
    eval_prompts: DatasetSpec = Field(
        default_factory=lambda: DatasetSpec(split="test"), description="Held-out prompts for generation evaluation."
    )
    # sized for real models: 1024 as TRL's RewardConfig and SFTConfig max_length; a prompt of 512 tokens and a
    # completion of 256 (rl.response_length; TRL 1.16's GRPOConfig generates up to 512) fit in it
    max_length: int = Field(
        1024,
        ge=4,
        description="Longest prompt+completion in tokens (preference pairs, the SFT text); longer rows are handled by `overlong`. `rlhf validate` prints each table's token lengths against it.",
    )
    max_prompt_length: int = Field(
        512,
        ge=1,
        description="Longest prompt in tokens for RL and evaluation prompts; longer ones are handled by `overlong`.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra keyword arguments for tokenizer.apply_chat_template on conversational data (e.g. enable_thinking).",
    )
    overlong: Literal["truncate", "drop"] = Field(
        "truncate", description="What to do with rows longer than the limits."
    )
    demo: DemoWorldConfig = Field(
        default_factory=DemoWorldConfig, description="Sizes of the offline demo world (used by 'demo' sources)."
    )

    @model_validator(mode="after")
    def _prompt_fits(self) -> DataConfig:
        if self.max_prompt_length >= self.max_length:
            raise ValueError(f"max_prompt_length {self.max_prompt_length} must be below max_length {self.max_length}")
        return self


def accelerate_strategy(path) -> str:
    """What an `accelerate launch` config file asks for: 'ddp', 'zero1'/'zero2'/'zero3', 'fsdp' (or 'fsdp1').

    Raises ValueError naming the file when it is missing, not YAML, or not an accelerate config.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"run.accelerate_config: {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"run.accelerate_config: {path} is not valid YAML ({err})") from None
    if not isinstance(raw, dict) or "distributed_type" not in raw:
        raise ValueError(f"run.accelerate_config: {path} has no distributed_type; write it with `accelerate config`")
    kind = str(raw["distributed_type"]).upper()
    if kind == "DEEPSPEED":
        stage = int((raw.get("deepspeed_config") or {}).get("zero_stage", 2))
        return f"zero{stage}"
    if kind == "FSDP":
        return "fsdp" if int((raw.get("fsdp_config") or {}).get("fsdp_version", 1)) == 2 else "fsdp1"
    return "ddp"
