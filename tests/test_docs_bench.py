"""docs/benchmarks.md quotes bench/results.json faithfully: its results table is the one bench/run.py writes
from results.json, row for row; the targets table's "measured" column is the ratio of the row and field it
names, rounded as shown; a table copied from a row's own tables (`table_md`) is a word-for-word copy; the
scaling summary and the figures quoted in the prose are those of results.json, rounded as the page shows them.
After `make bench`, copy the table from bench/results.md and the row tables that changed, and fix what this test
names. (The served-rewards table quotes bench/results/served_rewards.json, which `make served-rewards` writes on
the machine it runs on and git does not keep: no test can read it on a fresh clone.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "benchmarks.md"
RESULTS = json.loads((REPO / "bench" / "results.json").read_text())["results"]
RESULTS_HEADER = "| benchmark | ours | anchor | ratio (ours / anchor) | notes |"
TARGETS_HEADER = "| target | row and field of `bench/results.json` | measured |"
SCALING_HEADER = "| algorithm | ours / TRL at 1M, 10M, 51M params (64 tokens) |"


def tables(text: str) -> list[list[str]]:
    """Every Markdown table of `text`: its lines, the header first."""
    found, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line.rstrip())
        elif current:
            found.append(current)
            current = []
    return found


def table(text: str, header_start: str) -> list[str]:
    matches = [t for t in tables(text) if t[0].startswith(header_start)]
    assert len(matches) == 1, f"docs/benchmarks.md has {len(matches)} tables whose header starts {header_start!r}"
    return matches[0]


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def results_row(name: str, r: dict) -> str:
    """A row of bench/results.md's table, as bench/run.py writes it."""
    compared = f"{r['gain']:+.3f} (gain)" if r.get("kind") == "gain" else f"{r['ratio']:.3f}"
    return (
        f"| {name} | {r['ours']:.4g} {r['unit']} | {r['anchor']:.4g} {r['unit']} ({r['anchor_name']}) | "
        f"{compared} | {r.get('notes', '')} |"
    )


def results_table_problems(text: str, results: dict) -> list[str]:
    rows = table(text, RESULTS_HEADER)[2:]
    expected = [results_row(name, r) for name, r in results.items()]
    pairs = enumerate(zip(rows, expected), 1)
    problems = [f"row {i} reads\n  {got}\nresults.json gives\n  {want}" for i, (got, want) in pairs if got != want]
    if len(rows) != len(expected):
        problems.append(f"the table has {len(rows)} rows, results.json {len(expected)} ({', '.join(results)})")
    return problems


def targets_problems(text: str, results: dict) -> list[str]:
    """Each target row that names `row field` of results.json shows that field's value, rounded as shown."""
    problems = []
    for line in table(text, TARGETS_HEADER)[2:]:
        target, source, measured = cells(line)
        words = source.split()
        if len(words) != 2 or words[0] not in results:
            continue
        value = results[words[0]][words[1]]
        shown = re.match(r"(\d+\.(\d+))x", measured)
        if not shown or f"{value:.{len(shown.group(2))}f}" != shown.group(1):
            problems.append(f"target {target!r}: measured {measured!r}, but {source} is {value}")
    return problems


def copied_table_problems(text: str, results: dict) -> list[str]:
    """A page table with the header of a table in a row's table_md is that table, line for line."""
    page = {t[0]: t for t in tables(text)}
    problems = []
    for name, r in results.items():
        for own in tables(r.get("table_md", "")):
            if own[0] in page and page[own[0]] != own:
                problems.append(f"the table {own[0]!r} differs from results.json's {name} table_md")
    return problems


def scaling_row(algo: str) -> str:
    s = RESULTS["scaling"]
    by = {(row["algo"], row["size"], row["length"]): row for row in s["rows"]}

    def ratio(size: str, length: int) -> str:
        row = by[(algo, size, length)]
        return f"{row['ours']['seconds_per_step'] / row['trl']['seconds_per_step']:.2f}"

    params, length = s["fits"][f"{algo}/params"], s["fits"][f"{algo}/length"]
    return (
        f"| {algo.upper()} | {', '.join(ratio(size, 64) for size in ('1M', '10M', '50M'))} | "
        f"{', '.join(ratio('10M', n) for n in (16, 64, 256))} | "
        f"{params['ours_time']:.2f} / {params['trl_time']:.2f} | {length['ours_time']:.2f} / {length['trl_time']:.2f} |"
    )


def quoted_figures() -> list[str]:
    """Phrases of the page's prose, each built from results.json as the page rounds it."""
    demo, grpo, rloo, over = RESULTS["demo"], RESULTS["grpo"], RESULTS["rloo"], RESULTS["overhead"]
    dp, ray = RESULTS["scaling"]["data_parallel"], RESULTS["ray"]
    one_core = dp["runs"]["1x1"]["seconds_per_step"]
    grid = RESULTS["scaling"]["rows"]
    lower = sum(row["ours"]["peak_rss_mb"] < row["trl"]["peak_rss_mb"] for row in grid)
    big_ppo = next(row for row in grid if row["algo"] == "ppo" and row["size"] == "50M" and row["length"] == 64)
    return [
        f"{rloo['ratio']:.2f} of `RLOOTrainer`'s time per step",
        f"({grpo['ratio']:.2f} in the table above)",
        f"gold +{demo['gain']:.2f} at an eval KL of {demo['kl']:.1f} nats with length x{demo['length_ratio']:.2f} "
        f"and distinct-2 x{demo['distinct_2_ratio']:.2f}",
        f"(beta {grpo['learning']['beta']} for {grpo['learning']['steps']} steps, gold "
        f"{grpo['learning']['gold_after']:.2f} at a KL of {grpo['learning']['kl_after']:.0f})",
        f"{dp['t2']:.2f} s per step, against {dp['t1']:.2f} s for one process using both cores",
        f"{one_core:.2f} s for one process on one core: {one_core / dp['t2']:.2f}x over one core "
        f"({100 * one_core / (2 * dp['t2']):.0f}% efficiency)",
        f"in the scaling grid at {lower} of {len(grid)} points",
        f"PPO {big_ppo['ours']['peak_rss_mb']:.0f} MB vs TRL's {big_ppo['trl']['peak_rss_mb']:.0f} MB",
        f"starting the instance {ray['startup']['init_s']:.1f} s",
        f"a new SQLite store {over['store_startup_s']:.2f} s ({over['store_first_s']:.1f} s for the first",
        f"config validation and preflight {over['validation_s']:.3f} s",
        f"the Prefect server's start-up {over['server_startup_s']:.1f} s",
        f"{over['server_cpu_s']['flow']:.1f} CPU-seconds per flow run against {over['server_cpu_s']['bare']:.1f}",
        f"{over['versions_registered']} registered versions took {over['registration_s']:.1f} s",
        f"logging 80 steps' metrics to the local store took {over['loop_s']['log']:.2f} s",
    ]


def missing_phrases(text: str, phrases: list[str]) -> list[str]:
    """The phrases not in `text`, both read with every run of whitespace as one space."""
    flat = " ".join(text.split())
    return [p for p in phrases if " ".join(p.split()) not in flat]


# the page -------------------------------------------------------------------------------------------------------


def test_the_results_table_is_results_json():
    problems = results_table_problems(PAGE.read_text(), RESULTS)
    assert not problems, "docs/benchmarks.md's results table:\n" + "\n".join(problems)


def test_the_targets_show_the_fields_they_name():
    problems = targets_problems(PAGE.read_text(), RESULTS)
    assert not problems, "\n".join(problems)


def test_copied_tables_are_word_for_word():
    problems = copied_table_problems(PAGE.read_text(), RESULTS)
    assert not problems, "\n".join(problems)
    headers = {t[0] for t in tables(PAGE.read_text())}
    copied = [n for n, r in RESULTS.items() for t in tables(r.get("table_md", "")) if t[0] in headers]
    assert {"ppo", "grpo", "overhead", "ray"} <= set(copied), f"the page copies tables of {sorted(set(copied))}"


def test_the_scaling_summary_is_the_grid():
    rows = table(PAGE.read_text(), SCALING_HEADER)[2:]
    assert rows == [scaling_row("ppo"), scaling_row("grpo")], f"the scaling summary reads {rows}"


def test_the_prose_quotes_results_json():
    missing = missing_phrases(PAGE.read_text(), quoted_figures())
    assert not missing, "docs/benchmarks.md does not say, as results.json gives them:\n" + "\n".join(missing)


# the checks themselves ------------------------------------------------------------------------------------------


def test_the_checks_see_a_changed_figure():
    text = PAGE.read_text()
    ratio = f"| {RESULTS['grpo']['ratio']:.3f} |"
    assert results_table_problems(text.replace(ratio, "| 0.999 |", 1), RESULTS)
    assert results_table_problems(text, {**RESULTS, "new": RESULTS["sft"]}), "a row missing from the page"
    assert targets_problems(text.replace("| grpo ratio | 0.45x |", "| grpo ratio | 0.40x |"), RESULTS)
    first_phase = tables(RESULTS["ppo"]["table_md"])[0][2]
    assert copied_table_problems(text.replace(first_phase, first_phase.replace("0.", "9.", 1)), RESULTS)
    rloo = f"{RESULTS['rloo']['ratio']:.2f} of `RLOOTrainer`'s"
    assert missing_phrases(text.replace(rloo, "0.40 of `RLOOTrainer`'s"), quoted_figures())


def test_phrases_match_across_line_breaks():
    assert missing_phrases("gold +0.53 at an eval\nKL of 2.2 nats", ["gold +0.53 at an eval KL of 2.2 nats"]) == []
    assert missing_phrases("gold +0.53", ["gold +0.52"]) == ["gold +0.52"]
