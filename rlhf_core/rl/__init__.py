"""One RL step for PPO and the GRPO family: what a trainer takes (one input object), where a step's batch comes
from (sampled in the step, or ahead), the phases of the step, the losses, dynamic sampling and the correction
between a rollout engine and the trainer; the advantage estimators live in `rl/advantages/`."""
