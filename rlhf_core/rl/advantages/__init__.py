"""The advantages phase: each estimator registered under its `rl.algorithm` name (`estimators`: GAE, GRPO's
group-relative, RLOO's leave-one-out, REINFORCE++ with and without a baseline) and the group statistics they
use (`group_baselines`)."""
