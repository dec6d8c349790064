"""A model's shape without its weights (`ModelShape`: sizes, parameter counts, the linear layers LoRA can target)
and what its passes keep per token: the activations backward needs (what a Llama-shaped decoder layer saves,
Korthikanti et al. 2022's count for SwiGLU, RoPE and SDPA attention, which keeps no attention matrix), a forward
without gradients, logits, the KV cache. The demo's tiny Llama is counted from model.demo by hand (no torch import:
`rlhf validate` on the demo stays light); a local directory or a hub name in the local Hugging Face cache is read
with `AutoConfig` and built on the meta device; nothing is downloaded. What memory.py estimates memory from."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from rlhf_core.config import DEMO, DemoModelConfig, LoraSettings, ModelConfig
from rlhf_core.models.loading import MODEL_BUILDING, looks_like_path

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FALLBACK_CHUNK_TOKENS = 256  # rlhf_core/models/forward.py's LOGITS_CHUNK_TOKENS, read there once torch is loaded
LOGIT_COPIES = 3  # a chunk's float32 logits, their softmax and, in backward, their gradient
RECOMPUTED_LAYERS = 2  # with checkpointing: the layer recomputed in backward, and the gradients of its activations
# the demo worlds' vocabularies before the world is built: the reviews world's words (2,200 at the default sizes
# and the smoke config's), the arithmetic and calculator worlds' characters
DEMO_VOCAB = {"reviews": 2200, "arithmetic": 15, "calculator": 24}


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on: the transformer's sizes, the causal LM's parameters (a tied embedding counted once),
    every linear layer but the LM head as (module name, in, out) for LoRA, and the dtype its weights load in."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    parameters: int
    linears: tuple[tuple[str, int, int], ...]
    dtype: str = "float32"

    @property
    def lm_head_parameters(self) -> int:
        """The LM head's own parameters: none when tied to the embedding."""
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def classifier_parameters(self) -> int:
        """The same body as a sequence classifier with one output (reward and value models): no LM head, a
        score head of hidden x 1 without bias."""
        return self.parameters - self.lm_head_parameters + self.hidden

    def lora_parameters(self, lora: LoraSettings) -> int:
        """PEFT's adapters on the linear layers `lora.target_modules` names (a module's name or its last parts, as
        PEFT matches them): r x (in + out) each."""
        targets = list(lora.target_modules)
        return sum(
            lora.r * (i + o) for name, i, o in self.linears if any(name == t or name.endswith("." + t) for t in targets)
        )


def llama_shape(
    vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, **options
) -> ModelShape:
    """A Llama-shaped decoder (Llama, Qwen2) counted by hand. `options`: tied (True), attention_bias (False; Qwen2's
    q, k and v carry one), dtype ('float32')."""
    tied, bias = options.get("tied", True), options.get("attention_bias", False)
    head_dim = hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = [
        ("self_attn.q_proj", hidden, q),
        ("self_attn.k_proj", hidden, kv),
        ("self_attn.v_proj", hidden, kv),
        ("self_attn.o_proj", q, hidden),
        ("mlp.gate_proj", hidden, intermediate),
        ("mlp.up_proj", hidden, intermediate),
        ("mlp.down_proj", intermediate, hidden),
    ]
    linears = tuple((f"model.layers.{i}.{name}", a, b) for i in range(layers) for name, a, b in per_layer)
    embeddings = vocab * hidden * (1 if tied else 2)
    biases = layers * (q + 2 * kv) if bias else 0
    norms = (2 * layers + 1) * hidden
    parameters = embeddings + sum(a * b for _, a, b in linears) + biases + norms
    return ModelShape(
        vocab, hidden, layers, heads, kv_heads, head_dim, intermediate, tied, parameters, linears,
        options.get("dtype", "float32"),
    )  # fmt: skip


def demo_shape(demo: DemoModelConfig, vocab: int) -> ModelShape:
    """The demo's tiny Llama (rlhf_core/demo/models.py build_demo_model): tied, as many KV heads as heads, fp32."""
    return llama_shape(
        vocab, demo.hidden_size, demo.num_hidden_layers, demo.num_attention_heads, demo.num_attention_heads,
        demo.intermediate_size,
    )  # fmt: skip


def demo_vocab(world_dir: Path, world: str) -> int:
    """The built demo world's vocabulary (its base model's config.json), else DEMO_VOCAB's for `world`."""
    try:
        return int(json.loads((world_dir / "base_model" / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return DEMO_VOCAB[world]


def config_dtype(config, torch_dtype: str) -> str:
    """The dtype weights load in: model.torch_dtype, or for 'auto' the config's own (float32 when it names none)."""
    if torch_dtype != "auto":
        return torch_dtype
    named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(named).removeprefix("torch.") if named is not None else "float32"
    return name if name in DTYPE_BYTES else "float32"


def shape_of_config(config, torch_dtype: str = "float32", *, trust_remote_code: bool = False) -> ModelShape:
    """The shape of the causal LM `config` (a transformers config) describes, counted on the meta device: no
    weights are allocated."""
    import torch
    from transformers import AutoModelForCausalLM

    with MODEL_BUILDING, torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    linears = tuple(
        (name, m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and m is not head
    )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    return ModelShape(
        vocab=embedding.weight.shape[0],
        hidden=text.hidden_size,
        layers=text.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        intermediate=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
        tied=head is None or head.weight is embedding.weight,
        parameters=sum(p.numel() for p in model.parameters()),
        linears=linears,
        dtype=config_dtype(config, torch_dtype),
    )


class ShapeReader:
    """The shapes of the sources one config names, each read once: a ModelShape, or why it is unknown (a phrase
    naming the field)."""

    def __init__(self, model: ModelConfig, world_dir: Path, world: str):
        self.model, self.world_dir, self.world = model, world_dir, world
        self.read: dict[str, ModelShape | str] = {}

    def __call__(self, source: str, field: str) -> ModelShape | str:
        if source not in self.read:
            self.read[source] = self._shape(str(source), field)
        return self.read[source]

    def _shape(self, source: str, field: str) -> ModelShape | str:
        model = self.model
        if source == DEMO:
            return demo_shape(model.demo, demo_vocab(self.world_dir, self.world))
        if source.startswith("models:/"):
            return f"{field} {source} is a registry version, read only when the run resolves it"
        from transformers import AutoConfig

        local = looks_like_path(source)
        where = str(Path(source).expanduser()) if local else source
        try:
            config = AutoConfig.from_pretrained(
                where,
                revision=None if local else model.revision,
                trust_remote_code=model.trust_remote_code,
                local_files_only=True,  # never a download
            )
        except (OSError, ValueError, KeyError):
            why = "has no readable config.json" if local else "is not in the local Hugging Face cache"
            return f"{field} {source} {why} (nothing is downloaded)"
        try:
            return shape_of_config(config, model.torch_dtype, trust_remote_code=model.trust_remote_code)
        except (ValueError, KeyError, TypeError, AttributeError, ImportError, RuntimeError) as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            return f"{field} {source} could not be built as a causal LM on the meta device ({first})"


def logits_chunk_tokens() -> int:
    """forward.LOGITS_CHUNK_TOKENS when that module is loaded and has it, else FALLBACK_CHUNK_TOKENS (imported
    only where loaded: the demo's estimate imports no torch)."""
    forward = sys.modules.get("rlhf_core.models.forward")
    return int(getattr(forward, "LOGITS_CHUNK_TOKENS", FALLBACK_CHUNK_TOKENS))


@dataclass(frozen=True)
class Precision:
    """Bytes per weight and whether autocast (run.mixed_precision bf16 or fp16) runs over them."""

    weights: int
    autocast: bool = False

    @property
    def activations(self) -> int:
        """Bytes per activation: 16-bit under autocast or with 16-bit weights."""
        return 2 if self.autocast or self.weights == 2 else 4

    @property
    def residual(self) -> int:
        """Bytes of the residual stream: float32 under autocast (fp32 embeddings plus 16-bit outputs)."""
        return 4 if self.autocast else self.weights


def layer_activation_bytes(shape: ModelShape, precision: Precision) -> float:
    """What one decoder layer keeps for backward, per token: two RMSNorms (their float32 input and normalized
    copy; under autocast also the 16-bit copy each of the five projections casts its input to), q, k and v with
    RoPE's rotated halves, the repeated k and v of grouped-query attention, SDPA's output and o_proj's input, and
    SwiGLU's gate, its SiLU, up and their product."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    norms = 16 * h + (10 * h if precision.autocast else 0)
    attention = 5 * q + 3 * kv + (2 * q if shape.kv_heads < shape.heads else kv)
    return norms + precision.activations * (attention + 4 * shape.intermediate)


def activation_bytes(shape: ModelShape, precision: Precision, tokens: int, checkpointing: bool) -> float:
    """The activations a forward keeps for backward over `tokens` tokens: every layer's, or with gradient
    checkpointing each layer's input plus the layer being recomputed, twice over (its activations and, as its
    backward runs, their gradients: measured on CPU, bench/studies/memory_estimate.py); the embedding's output, the
    final norm and the head's input beside them."""
    per_layer = layer_activation_bytes(shape, precision)
    if checkpointing:
        layers = shape.layers * shape.hidden * precision.residual + RECOMPUTED_LAYERS * per_layer
    else:
        layers = shape.layers * per_layer
    return tokens * (layers + 4 * shape.hidden * precision.residual)


def no_grad_bytes(shape: ModelShape, precision: Precision, tokens: int) -> float:
    """A forward without gradients at its widest, one layer's MLP: the stream, its norm, the gate, up, product."""
    return tokens * precision.activations * (2 * shape.hidden + 3 * shape.intermediate)


def logits_bytes(shape: ModelShape, tokens: int, chunked: bool = True) -> float:
    """Float32 logits of `tokens` positions (at most one chunk of them when `chunked`) and their copies."""
    return LOGIT_COPIES * (min(tokens, logits_chunk_tokens()) if chunked else tokens) * shape.vocab * 4


def kv_cache_bytes(shape: ModelShape, sequences: int, tokens: int, bytes_per_value: int) -> int:
    """The decode loop's cache: sequences x tokens x layers x (k, v) x KV heads x head size."""
    return sequences * tokens * shape.layers * 2 * shape.kv_heads * shape.head_dim * bytes_per_value
