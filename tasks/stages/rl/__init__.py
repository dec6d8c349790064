"""The RL stage (`stage`: PPO or the GRPO family as one Prefect task) and what only it uses: the guard that judges
its evaluations, its reporting and evaluation report, the rows of its held-out evaluations, the checkpoint it hands
on and its rewards served elsewhere."""
