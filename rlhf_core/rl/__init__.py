"""One RL step: rollout -> advantages -> update -> metrics (`step`), for PPO (`ppo`) and the GRPO family (`grpo`,
its losses in `grpo_losses`, dynamic sampling in `dynamic_sampling`); the advantage estimators live in
`rl/advantages/`."""
