"""One Prefect task per pipeline stage, in DAG order: `data`, `sft`, `reward_model`, `initialization`, the RL stage
(the `rl` package, with what only it uses), `export`, and promotion's `version_evaluation`."""
