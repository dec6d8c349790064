"""The rows of `make bench` (bench/run.py, which names each module's row): each module times our code and its
anchor in the same run on identical work and writes ours / anchor to --out, its name saying what against what
(`grpo_vs_trl`: `train_grpo` against TRL's GRPOTrainer); `demo_gold_gain` is the one row that reports a gain
over the policy the demo started from rather than a ratio."""
