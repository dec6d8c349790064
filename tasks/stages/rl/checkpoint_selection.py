"""Which RL checkpoint the stage hands on to export: `export.select` applied to the checkpoints on disk.

'last' takes the newest complete checkpoint; 'best' the one with the highest promotion metric among
those whose held-out evaluation passed every guard rule (the guard's ledger holds the evaluations and
the verdicts).
"""

from __future__ import annotations

from pathlib import Path

from rlhf_core.config import PipelineConfig
from rlhf_core.evaluation.guard import GuardLedger, GuardStopError
from tasks.launch import launcher
from tasks.stage_io import checkpoint_steps


def select_step(cfg: PipelineConfig, ledger: GuardLedger, out_dir: Path, stage: str, logger) -> int:
    """The checkpoint step export.select picks: 'last', or 'best' (the highest promotion metric among
    checkpoints whose evaluation passed every guard rule; the last passed, then the last, when none is
    scored). Raises a sentence when the guard stopped RL before any checkpoint was saved."""
    steps = checkpoint_steps(out_dir)
    if not steps:
        raise GuardStopError(
            f"the guard stopped {stage} at step {ledger.stopped_at} before any checkpoint was saved, "
            f"so there is no policy to export; see the guard triggers of the {stage} run "
            "(lower rl.save_steps, or loosen guard.*)"
        )
    last = max(steps)
    if cfg.export.select == "last" or not launcher.is_main():  # the others' ledgers hold no evaluations
        return last
    metric_key = f"eval/{cfg.selection_metric()}_mean"
    chosen = ledger.best(steps, metric_key) or ledger.last_passed(steps)
    if not any(s in ledger.evals for s in steps):
        logger.warning("no %s checkpoint step had an evaluation: exporting the last one (step %d)", stage, last)
        return last
    if chosen is None or chosen == 0:
        logger.warning("no %s checkpoint passed every guard rule: exporting the last one (step %d)", stage, last)
        return last
    if chosen != last:
        logger.info(
            "export.select best: step %d (%s %.3f), not the last step %d",
            chosen,
            metric_key,
            ledger.evals[chosen].get(metric_key, float("nan")),
            last,
        )
    return chosen
