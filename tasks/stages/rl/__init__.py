"""The RL stage (`stage`: PPO or the GRPO family as one Prefect task) and what only it uses: its reporting, the
rows of its held-out evaluations, the guard, the checkpoint it hands on and its rewards served elsewhere."""
