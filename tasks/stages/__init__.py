"""One Prefect task per pipeline stage, in DAG order: `data`, `sft`, `reward_model`, `initialization`, `rl` (with
its reporting, evaluation rows and `guard`), `export` (and `checkpoint_selection`), and promotion's
`version_evaluation`."""
