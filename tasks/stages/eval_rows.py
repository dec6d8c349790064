"""The RL stage's held-out evaluations on disk: one Parquet file of rows per evaluation step.

<out_dir>/eval/eval_step_NNNNNN.parquet holds the rows of one evaluation (prompt, completion, scores),
each with its step. The stage writes them as it evaluates; its report and the pipeline's final samples
read them back.
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
    for path in sorted((out_dir / "eval").glob("eval_step_*.parquet")):
        frame = pd.read_parquet(path)
        rows = [
            {k: (None if isinstance(v, float) and v != v else v) for k, v in r.items() if k != "step"}
            for r in frame.to_dict(orient="records")
        ]
        history[int(path.stem.rsplit("_", 1)[1])] = rows
    return history
