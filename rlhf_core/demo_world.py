"""The offline demo world: a review corpus, a tokenizer, a tiny Llama, preferences and prompts.

Everything is built from the VADER lexicon that the `vaderSentiment` package ships, deterministically
from a seed, in a few seconds, with no download. VADER's compound score labels the preference pairs
and is the demo's gold metric (see :mod:`rlhf_core.reward_functions`).

The world is shaped like the chat models people align: its data is conversational (TRL's message
lists: the user gives the start of a review, the assistant finishes it), its tokenizer has a
ChatML-like chat template that ends each turn with `<|im_end|>`, its pad token is its eos
(`<|endoftext|>`, as Qwen2.5 base), and its model stops on two ids (`<|im_end|>` and `<|endoftext|>`,
as Qwen2.5-Instruct's generation_config). Decoding puts a space where words meet.

Layout of a built world (all paths relative to its directory)::

    corpus.jsonl                      {"messages"}                  SFT warm-start corpus
    preferences/train.jsonl, test.jsonl  {"prompt", "chosen", "rejected"} (message lists)
    prompts/train.jsonl, test.jsonl   {"prompt"} (message lists)    held-out prompts in test
    tokenizer/                        Hugging Face tokenizer files (word level, chat template)
    base_model/                       tiny LlamaForCausalLM, random init, safetensors
    manifest.json                     build key and sha256 of every file
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from rlhf_core.config import DEMO, DemoModelConfig, DemoWorldConfig
from rlhf_core.data import Kind
from rlhf_core.reward_functions import vader_analyzer
from rlhf_core.saving import apply_umask

WORLD_VERSION = 2  # bump when the generator changes, so cached worlds are rebuilt (2: conversational)

UNK, BOS, EOS = "<unk>", "<bos>", "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"  # a turn's start and end (the first stop id)
SPECIAL_TOKENS = [UNK, BOS, EOS, IM_START, IM_END]
# ChatML with the bos written by the template (as Llama 3's): the policy answers after '<|im_start|>assistant'
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ROLES = ["system", "user", "assistant"]

NOUNS = [
    "food",
    "service",
    "staff",
    "room",
    "movie",
    "plot",
    "book",
    "hotel",
    "price",
    "music",
    "coffee",
    "pizza",
    "menu",
    "waiter",
    "view",
    "bed",
    "screen",
    "battery",
    "camera",
    "phone",
    "show",
    "ending",
    "story",
    "soup",
    "beer",
    "wine",
    "dessert",
    "app",
    "game",
    "seller",
    "delivery",
    "pool",
    "lobby",
    "acting",
    "soundtrack",
    "keyboard",
    "charger",
    "burger",
    "salad",
    "trip",
]
# `{a}` is the first description slot: the prompt ends right before it.
TEMPLATES = [
    "the {n} was {a} .",
    "the {n} is {a} .",
    "overall the {n} felt {a} .",
    "i found the {n} {a} .",
    "honestly the {n} was {a} .",
    "our {n} was {a} .",
    "the {n} seemed {a} .",
    "this {n} is {a} .",
    "the {n} was {a} and the {m} was {b} .",
    "i thought the {n} was {a} but the {m} was {b} .",
    "the {n} looked {a} and tasted {b} .",
    "my {n} arrived {a} .",
]
OPENERS = ["", "we went on friday .", "second visit .", "bought it last month .", "came here with friends ."]
# Plain descriptors that VADER scores 0; the corpus uses each of them often, so an SFT model's most
# likely continuation is neutral and RL has room to move it.
NEUTRAL_WORDS = ["ordinary", "average", "typical", "standard", "regular", "plain", "usual", "normal", "simple", "basic"]
NEUTRAL_SHARE = 0.4
POLAR_MIN = 2.0  # |mean valence| of lexicon words used as positive / negative descriptors


@dataclass(frozen=True)
class DemoWorld:
    """Paths of a built demo world."""

    root: Path

    @property
    def corpus(self) -> Path:
        return self.root / "corpus.jsonl"

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

    @property
    def base_model(self) -> Path:
        return self.root / "base_model"

    def preferences(self, split: str) -> Path:
        return self.root / "preferences" / f"{split}.jsonl"

    def prompts(self, split: str) -> Path:
        return self.root / "prompts" / f"{split}.jsonl"

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"


def load_vader_lexicon() -> dict[str, float]:
    """word -> mean valence, from the lexicon file inside the vaderSentiment package."""
    text = resources.files("vaderSentiment").joinpath("vader_lexicon.txt").read_text(encoding="utf-8")
    lexicon = {}
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) >= 2:
            lexicon[parts[0]] = float(parts[1])
    return lexicon


def polar_words(lexicon: dict[str, float]) -> tuple[list[str], list[str]]:
    """Alphabetic lexicon words with |valence| >= POLAR_MIN: (positive, negative), sorted."""
    words = sorted(w for w in lexicon if re.fullmatch(r"[a-z]{3,}", w))
    return [w for w in words if lexicon[w] >= POLAR_MIN], [w for w in words if lexicon[w] <= -POLAR_MIN]


class _Writer:
    """Fills template slots with neutral, positive or negative descriptors."""

    def __init__(self, rng: random.Random, lexicon: dict[str, float]):
        self.rng = rng
        self.positive, self.negative = polar_words(lexicon)
        self.neutral = [w for w in NEUTRAL_WORDS if w not in lexicon]

    def descriptor(self) -> str:
        u = self.rng.random()
        if u < NEUTRAL_SHARE:
            return self.rng.choice(self.neutral)
        pool = self.positive if u < NEUTRAL_SHARE + (1 - NEUTRAL_SHARE) / 2 else self.negative
        return self.rng.choice(pool)

    def prefix(self) -> tuple[str, str]:
        """(prompt, template) for a random opener, template and noun."""
        opener = self.rng.choice(OPENERS)
        template = self.rng.choice(TEMPLATES)
        noun = self.rng.choice(NOUNS)
        head = template.split("{a}")[0].format(n=noun)
        return (f"{opener} {head}".strip(), template)

    def completion(self, template: str) -> str:
        """The text after the prompt: first slot, the rest of the template, and the period."""
        tail = "{a}" + template.split("{a}", 1)[1]
        other = self.rng.choice(NOUNS)
        return " " + tail.format(a=self.descriptor(), b=self.descriptor(), m=other)


def user_turn(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def assistant_turn(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text.strip()}]


def _prompt_key(prompt: str) -> int:
    return int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16)


def _is_eval_prompt(prompt: str) -> bool:
    """A fixed 15% of all possible prompts is held out, whatever the seed."""
    return _prompt_key(prompt) % 100 < 15


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")


def _sample_prefixes(writer: _Writer, want_eval: bool, n: int) -> list[tuple[str, str]]:
    out = []
    while len(out) < n:
        prompt, template = writer.prefix()
        if _is_eval_prompt(prompt) == want_eval:
            out.append((prompt, template))
    return out


def _preference_pairs(writer: _Writer, prefixes: list[tuple[str, str]], min_gap: float) -> list[dict]:
    vader = vader_analyzer()
    rows = []
    for prompt, template in prefixes:
        while True:
            a, b = writer.completion(template), writer.completion(template)
            sa = vader.polarity_scores(prompt + a)["compound"]
            sb = vader.polarity_scores(prompt + b)["compound"]
            if abs(sa - sb) >= min_gap:
                break
        chosen, rejected = (a, b) if sa > sb else (b, a)
        rows.append(
            {"prompt": user_turn(prompt), "chosen": assistant_turn(chosen), "rejected": assistant_turn(rejected)}
        )
    return rows


def _distinct_prompts(writer: _Writer, want_eval: bool, n: int) -> list[dict]:
    seen: dict[str, None] = {}
    attempts = 0
    while len(seen) < n and attempts < 200 * n:
        prompt, _ = writer.prefix()
        attempts += 1
        if _is_eval_prompt(prompt) == want_eval:
            seen.setdefault(prompt)
    return [{"prompt": user_turn(p)} for p in seen]


def train_word_tokenizer(texts: list[str], max_length: int):
    """A word-level chat tokenizer as a HF fast tokenizer: lower-cased, whitespace split, bos prepended to
    plain text, `<|im_start|>`/`<|im_end|>` special, pad == eos, CHAT_TEMPLATE, and a decoder that joins
    words with spaces (without one, decoded words run together: "waswas")."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(texts, trainer=trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS))
    # special tokens are matched in raw text before the split ("<|im_start|>user" is two tokens)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # " ".join(words); no word starts with ##
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=UNK,
        model_max_length=max_length,
        extra_special_tokens=[IM_START, IM_END],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_demo_model(tokenizer, cfg: DemoModelConfig, seed: int):
    """A randomly initialized tiny LlamaForCausalLM sized by `cfg`, matched to `tokenizer`."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        # no pad id in the model config (as Qwen2.5's): with one, the embedding's padding_idx would start
        # the eos (== pad) row at zero and give it no gradient, so the token everything ends on would be blank
        pad_token_id=None,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # two stop ids, the end of turn first, as an instruct model's generation_config
    stops = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.eos_token_id]
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=stops, pad_token_id=tokenizer.pad_token_id
    )
    return model


def _file_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }


def world_key(seed: int, world: DemoWorldConfig, model: DemoModelConfig) -> dict:
    return {"version": WORLD_VERSION, "seed": seed, "world": world.model_dump(), "model": model.model_dump()}


def load_cached_world(root: Path, key: dict) -> DemoWorld | None:
    """The world at `root` if it was built with `key` and no file changed since; else None."""
    world = DemoWorld(Path(root))
    if not world.manifest.is_file():
        return None
    try:
        manifest = json.loads(world.manifest.read_text())
    except json.JSONDecodeError:
        return None
    if manifest.get("key") != key or manifest.get("files") != _file_hashes(world.root):
        return None
    return world


def build_demo_world(
    root: str | Path, seed: int, world: DemoWorldConfig, model: DemoModelConfig, progress=None
) -> DemoWorld:
    """Build the demo world into `root` (or reuse it when cached with the same key).

    The build writes to a temporary sibling directory and renames it into place, so an interrupted
    build never leaves a half-written world. `progress(done, total, what)` is called per step.
    """
    root = Path(root)
    key = world_key(seed, world, model)
    cached = load_cached_world(root, key)
    if cached is not None:
        return cached
    steps = ["corpus", "prompts", "preferences", "tokenizer", "base model"]
    report = progress or (lambda done, total, what: None)

    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    try:
        out = DemoWorld(tmp)
        lexicon = load_vader_lexicon()
        writer = _Writer(random.Random(seed), lexicon)

        report(0, len(steps), steps[0])
        corpus = []
        for _ in range(world.num_sentences):
            prompt, template = writer.prefix()
            corpus.append({"messages": user_turn(prompt) + assistant_turn(writer.completion(template))})
        _write_jsonl(out.corpus, corpus)

        report(1, len(steps), steps[1])
        train_prompts = _distinct_prompts(writer, False, world.num_train_prompts)
        eval_prompts = _distinct_prompts(writer, True, world.num_eval_prompts)
        _write_jsonl(out.prompts("train"), train_prompts)
        _write_jsonl(out.prompts("test"), eval_prompts)

        report(2, len(steps), steps[2])
        train_pairs = _preference_pairs(
            writer, _sample_prefixes(writer, False, world.num_preference_pairs), world.min_compound_gap
        )
        eval_pairs = _preference_pairs(
            writer, _sample_prefixes(writer, True, world.num_eval_preference_pairs), world.min_compound_gap
        )
        _write_jsonl(out.preferences("train"), train_pairs)
        _write_jsonl(out.preferences("test"), eval_pairs)

        report(3, len(steps), steps[3])
        # every descriptor is in the vocabulary, even ones the sampled corpus happened to miss
        template_words = [re.sub(r"\{\w\}", " ", t) for t in TEMPLATES]
        words = writer.positive + writer.negative + writer.neutral + NOUNS + OPENERS + template_words + ROLES
        texts = [" ".join(m["content"] for m in r["messages"]) for r in corpus]
        texts += [" ".join(r[k][0]["content"] for k in ("prompt", "chosen", "rejected")) for r in train_pairs]
        vocab_text = [" ".join(words)]
        tokenizer = train_word_tokenizer(vocab_text + texts, model.max_position_embeddings)
        tokenizer.save_pretrained(out.tokenizer)

        report(4, len(steps), steps[4])
        lm = build_demo_model(tokenizer, model, seed)
        lm.save_pretrained(out.base_model)
        tokenizer.save_pretrained(out.base_model)

        out.manifest.write_text(json.dumps({"key": key, "files": _file_hashes(tmp)}, indent=2, sort_keys=True))
        report(len(steps), len(steps), "done")
        if root.exists():
            shutil.rmtree(root)
        apply_umask(tmp)  # mkdtemp's 0700 and safetensors' 0600 files: the umask's modes instead
        tmp.rename(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return DemoWorld(root)


def world_rows(world: DemoWorld, kind: Kind, split: str = "train") -> list[dict]:
    """The world's `kind` table ('preference', 'prompt' or 'text' for the corpus) as the pipeline reads it:
    templated with the world's tokenizer by `rlhf_core.data.load_table`, as the stages receive it."""
    from rlhf_core.config import DatasetSpec
    from rlhf_core.data import load_table
    from rlhf_core.models import load_tokenizer

    files = {"preference": world.preferences(split), "prompt": world.prompts(split), "text": world.corpus}
    spec = DatasetSpec(path=DEMO, split=split)
    tokenizer = load_tokenizer(str(world.tokenizer))
    table = load_table(spec, kind, field="demo", resolved_path=str(files[kind]), tokenizer=tokenizer)
    return table.to_list()
