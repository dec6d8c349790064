"""The rollout phase of an RL step: the decode loop (`generation`), sampling settings (`sampling`), the engines that
sample (`engines`, `vllm_server`, and the generators ahead of training in `ahead`), tool episodes (`episodes`,
`tools`), and `collect`: a batch sampled (`sample` -> `Sampled`), then scored into a `Rollout`."""
