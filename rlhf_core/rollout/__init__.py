"""The rollout phase of an RL step: the decode loop (`generation`), sampling settings (`sampling`), and
`collect`, which turns prompts into a `RolloutBatch` of completions, masks and log-probs."""
