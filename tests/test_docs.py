"""README.md and docs/ hold together: every relative link points at a file that exists, and a link's
#anchor into a Markdown file at a heading that exists there; README.md stays short and starts with the
two commands."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 300

FENCE = re.compile(r"^(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lowercase, punctuation dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor in `page`, with GitHub's -1, -2 ... suffixes for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(page.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        base = anchor(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(page: Path) -> list[str]:
    """The targets of the Markdown links of `page`, outside code blocks and code spans."""
    return [m.group(1) for line in prose_lines(page.read_text()) for m in LINK.finditer(CODE_SPAN.sub("", line))]


def shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def broken_links(page: Path) -> list[str]:
    problems = []
    for target in links(page):
        if EXTERNAL.match(target):
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / unquote(path)).resolve() if path else page
        if not file.exists():
            problems.append(f"{target} (no file {shown(file)})")
        elif fragment and file.suffix == ".md" and unquote(fragment).lower() not in anchors(file):
            problems.append(f"{target} (no heading with the anchor #{fragment} in {shown(file)})")
    return problems


def test_anchor_follows_github():
    assert anchor("Five minutes to your own model and data") == "five-minutes-to-your-own-model-and-data"
    assert anchor("DAPO's soft overlong punishment") == "dapos-soft-overlong-punishment"
    assert anchor("Formats: TRL's dataset types") == "formats-trls-dataset-types"
    assert anchor("The `grpo` section (GSPO)") == "the-grpo-section-gspo"
    assert anchor("Processes, GPUs, DeepSpeed and FSDP") == "processes-gpus-deepspeed-and-fsdp"


def test_the_checker_sees_broken_links(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n")
    page.write_text(
        "# Page\n\n[ok](other.md#a-section) [here](#page) [web](https://example.com/x#y)\n"
        "[missing](nowhere.md) [bad anchor](other.md#no-such) `[code](ignored.md)`\n\n"
        "```\n[fenced](ignored.md)\n# not a heading\n```\n"
    )
    problems = broken_links(page)
    assert len(problems) == 2, problems
    assert problems[0].startswith("nowhere.md") and problems[1].startswith("other.md#no-such")
    assert "not-a-heading" not in anchors(page)


def test_every_relative_link_points_at_a_file_and_heading():
    problems = {str(page.relative_to(REPO)): broken_links(page) for page in PAGES}
    problems = {page: found for page, found in problems.items() if found}
    assert not problems, f"broken links: {problems}"


def test_readme_is_short():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; move detail into docs/ (at most {README_MAX_LINES})"
    )


def test_readme_starts_with_the_two_commands():
    text = (REPO / "README.md").read_text()
    block = re.search(r"^```[^\n]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert block, "README.md has no command block"
    assert "make demo" in block.group(1) and "make test" in block.group(1), (
        f"README.md's first command block must hold `make demo` and `make test`, not:\n{block.group(1)}"
    )


def test_readme_links_every_docs_page():
    readme = (REPO / "README.md").read_text()
    unlinked = [p.name for p in sorted((REPO / "docs").glob("*.md")) if f"](docs/{p.name})" not in readme]
    assert not unlinked, f"README.md's table of contents does not link {unlinked}"
