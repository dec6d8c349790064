"""Rewards: the Bradley-Terry reward model and its training (`reward_model`), reward and metric functions
(`functions`), and the sources a rollout is scored by (`sources`)."""
