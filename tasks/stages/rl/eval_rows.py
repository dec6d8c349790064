"""The RL stage's held-out evaluations on disk: one Parquet file of rows per evaluation step.

<out_dir>/eval/eval_step_NNNNNN.parquet holds the rows of one evaluation (prompt, completion, scores),
each with its step. The stage writes them as it evaluates; its report and the pipeline's final samples
read them back. A guard rollback sets the evaluations after the step it goes back to aside with the
checkpoints, under <out_dir>/rolled_back/<attempt>/eval/: the report draws them as the attempt they were.
"""

from __future__ import annotations

from pathlib import Path

from rlhf_core.data.chat import shown_prompt


def readable_rows(rows: list[dict], step: int | None = None) -> list[dict]:
    """Rows as a person reads them in MLflow's and Prefect's tables: `prompt` is the user's text, the
    templated prompt the policy saw is kept as `rendered_prompt`, and `step` leads when given."""
    lead = {"step": step} if step is not None else {}
    return [
        {
            **lead,
            "prompt": shown_prompt(r["prompt"]),
            **{k: v for k, v in r.items() if k != "prompt"},
            "rendered_prompt": r["prompt"],
        }
        for r in rows
    ]


def save_eval_rows(out_dir: Path, rows: list[dict], step: int) -> Path:
    """<out_dir>/eval/eval_step_NNNNNN.parquet: the rows of one evaluation, with their step."""
    import pandas as pd

    path = out_dir / "eval" / f"eval_step_{step:06d}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".parquet.tmp")
    pd.DataFrame([{"step": step, **r} for r in rows]).to_parquet(tmp)
    tmp.replace(path)
    return path


def load_eval_history(out_dir: Path) -> dict[int, list[dict]]:
    """step -> rows of every evaluation saved under <out_dir>/eval."""
    import pandas as pd

    history = {}
    for step, path in _eval_files(out_dir):
        frame = pd.read_parquet(path)
        rows = [
            {k: (None if isinstance(v, float) and v != v else v) for k, v in r.items() if k != "step"}
            for r in frame.to_dict(orient="records")
        ]
        history[step] = rows
    return history


def set_aside_eval_rows(out_dir: Path, after_step: int, attempt: int) -> list[Path]:
    """Move the evaluations of `out_dir` after `after_step` into <out_dir>/rolled_back/<attempt>/eval/ (a guard
    rollback: the next attempt evaluates those steps again); the files moved."""
    moved = []
    for step, path in _eval_files(out_dir):
        if step > after_step:
            target = out_dir / "rolled_back" / str(attempt) / "eval" / path.name
            target.parent.mkdir(parents=True, exist_ok=True)
            path.replace(target)
            moved.append(target)
    return moved


def set_aside_history(out_dir: Path) -> dict[int, dict[int, list[dict]]]:
    """attempt -> step -> rows of the evaluations a rollback set aside (`set_aside_eval_rows`)."""
    root = out_dir / "rolled_back"
    attempts = sorted(int(p.name) for p in root.glob("*") if p.name.isdigit()) if root.is_dir() else []
    return {a: history for a in attempts if (history := load_eval_history(root / str(a)))}


def _eval_files(out_dir: Path) -> list[tuple[int, Path]]:
    return [(int(p.stem.rsplit("_", 1)[1]), p) for p in sorted((out_dir / "eval").glob("eval_step_*.parquet"))]
