"""The offline demo world: a review corpus, a tokenizer, a tiny Llama, preferences and prompts; or, with
data.demo.world 'arithmetic', additions to verify (`arithmetic.py`: corpus of labelled problems,
prompts with an `answer` column, no preferences); or 'calculator', multiplications and a tool (`calculator.py`).

Everything is built from the VADER lexicon that the `vaderSentiment` package ships, deterministically
from a seed, in a few seconds, with no download: the conversational text by :mod:`rlhf_core.demo.text`
(the user gives the start of a review, the assistant finishes it; VADER labels the pairs), the chat
tokenizer and the model by :mod:`rlhf_core.demo.models`. This module builds a world into a directory,
reuses it while its manifest matches, and reads its tables as the pipeline does.

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
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rlhf_core.config import DEMO, DemoModelConfig, DemoWorldConfig
from rlhf_core.data.rows import Kind
from rlhf_core.demo.arithmetic import build_arithmetic_model, build_digit_tokenizer, world_splits
from rlhf_core.demo.calculator import build_calculator_tokenizer
from rlhf_core.demo.calculator import world_splits as calculator_splits
from rlhf_core.demo.models import ROLES, build_demo_model, train_word_tokenizer
from rlhf_core.demo.text import (
    ReviewWriter,
    corpus_rows,
    distinct_prompts,
    load_vader_lexicon,
    preference_pairs,
    sample_prefixes,
)
from rlhf_core.storage.saving import apply_umask

# bump when what rlhf_core.demo.text or rlhf_core.demo.models build changes, so cached worlds are rebuilt
# (2: conversational; 3: the arithmetic world; 4: the calculator world)
WORLD_VERSION = 4


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


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")


def _tokenizer_texts(writer: ReviewWriter, corpus: list[dict], train_pairs: list[dict]) -> list[str]:
    """What the word tokenizer is trained on: every word the writer and the chat template can write (even
    ones the sampled corpus happened to miss), then the corpus and the training pairs."""
    words = writer.vocabulary() + ROLES
    texts = [" ".join(m["content"] for m in r["messages"]) for r in corpus]
    texts += [" ".join(r[k][0]["content"] for k in ("prompt", "chosen", "rejected")) for r in train_pairs]
    return [" ".join(words)] + texts


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
    """Build the demo world (data.demo.world: reviews or arithmetic) into `root`, or reuse it when cached
    with the same key.

    The build writes to a temporary sibling directory and renames it into place, so an interrupted
    build never leaves a half-written world. `progress(done, total, what)` is called per step.
    """
    root = Path(root)
    key = world_key(seed, world, model)
    cached = load_cached_world(root, key)
    if cached is not None:
        return cached
    report = progress or (lambda done, total, what: None)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    try:
        write = {"arithmetic": _write_arithmetic, "calculator": _write_calculator}.get(world.world, _write_reviews)
        steps = write(DemoWorld(tmp), seed, world, model, report)
        DemoWorld(tmp).manifest.write_text(
            json.dumps({"key": key, "files": _file_hashes(tmp)}, indent=2, sort_keys=True)
        )
        report(steps, steps, "done")
        if root.exists():
            shutil.rmtree(root)
        apply_umask(tmp)  # mkdtemp's 0700 and safetensors' 0600 files: the umask's modes instead
        tmp.rename(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return DemoWorld(root)


def _write_reviews(out: DemoWorld, seed: int, world: DemoWorldConfig, model: DemoModelConfig, report) -> int:
    """The review world's files into `out`; the number of steps reported."""
    steps = ["corpus", "prompts", "preferences", "tokenizer", "base model"]
    lexicon = load_vader_lexicon()
    writer = ReviewWriter(random.Random(seed), lexicon)

    report(0, len(steps), steps[0])
    corpus = corpus_rows(writer, world.num_sentences)
    _write_jsonl(out.corpus, corpus)

    report(1, len(steps), steps[1])
    _write_jsonl(out.prompts("train"), distinct_prompts(writer, False, world.num_train_prompts))
    _write_jsonl(out.prompts("test"), distinct_prompts(writer, True, world.num_eval_prompts))

    report(2, len(steps), steps[2])
    train_pairs = preference_pairs(
        writer, sample_prefixes(writer, False, world.num_preference_pairs), world.min_compound_gap
    )
    eval_pairs = preference_pairs(
        writer, sample_prefixes(writer, True, world.num_eval_preference_pairs), world.min_compound_gap
    )
    _write_jsonl(out.preferences("train"), train_pairs)
    _write_jsonl(out.preferences("test"), eval_pairs)

    report(3, len(steps), steps[3])
    tokenizer = train_word_tokenizer(_tokenizer_texts(writer, corpus, train_pairs), model.max_position_embeddings)
    tokenizer.save_pretrained(out.tokenizer)

    report(4, len(steps), steps[4])
    build_demo_model(tokenizer, model, seed).save_pretrained(out.base_model)
    tokenizer.save_pretrained(out.base_model)
    return len(steps)


def _write_arithmetic(out: DemoWorld, seed: int, world: DemoWorldConfig, model: DemoModelConfig, report) -> int:
    """The arithmetic world's files into `out` (`arithmetic.py`): the labelled problems as the corpus, problems
    without answers as train prompts, held-out problems as test prompts; no preferences."""
    report(0, 2, "problems")
    splits = world_splits(
        seed, num_sft=world.num_labelled, num_rl=world.num_train_prompts, num_eval=world.num_eval_prompts
    )
    return _write_problems(out, splits, build_digit_tokenizer(model.max_position_embeddings), model, seed, report)


def _write_calculator(out: DemoWorld, seed: int, world: DemoWorldConfig, model: DemoModelConfig, report) -> int:
    """The calculator world's files into `out` (`calculator.py`): chats solving labelled problems (some with the
    tool) as the corpus, problems without answers as train prompts, held-out problems as test prompts."""
    report(0, 2, "problems")
    splits = calculator_splits(
        seed, world.num_labelled, world.num_train_prompts, world.num_eval_prompts, world.tool_call_fraction
    )
    tokenizer = build_calculator_tokenizer(model.max_position_embeddings)
    return _write_problems(out, splits, tokenizer, model, seed, report)


def _write_problems(out: DemoWorld, splits: dict, tokenizer, model: DemoModelConfig, seed: int, report) -> int:
    """A problem world's splits (sft, rl, eval), its tokenizer, and the tiny Llama built over it, into `out`."""
    _write_jsonl(out.corpus, splits["sft"])
    _write_jsonl(out.prompts("train"), splits["rl"])
    _write_jsonl(out.prompts("test"), splits["eval"])
    report(1, 2, "tokenizer and base model")
    tokenizer.save_pretrained(out.tokenizer)
    build_arithmetic_model(tokenizer, model, seed).save_pretrained(out.base_model)
    tokenizer.save_pretrained(out.base_model)
    return 2


def world_rows(world: DemoWorld, kind: Kind, split: str = "train") -> list[dict]:
    """The world's `kind` table ('preference', 'prompt' or 'text' for the corpus) as the pipeline reads it:
    templated with the world's tokenizer by `rlhf_core.data.tables.load_table`, as the stages receive it."""
    from rlhf_core.config import DatasetSpec
    from rlhf_core.data.tables import load_table
    from rlhf_core.models.loading import load_tokenizer

    files = {"preference": world.preferences(split), "prompt": world.prompts(split), "text": world.corpus}
    spec = DatasetSpec(path=DEMO, split=split)
    tokenizer = load_tokenizer(str(world.tokenizer))
    table = load_table(spec, kind, field="demo", resolved_path=str(files[kind]), tokenizer=tokenizer)
    return table.to_list()
