"""Studies, one per Makefile target, each run on several seeds or settings and written to bench/results/<name>.md
and .json: the demo's robustness (`demo_seeds`, `make demo-seeds`), RLVR against its SFT control (`rlvr`), tool
use against GRPO without the tool (`tool_use`, `make tools`), generation ahead of training (`async_rollouts`),
rewards served over HTTP against in-process (`served_rewards`); and GRPO at real sizes on a GPU (`gpu_real_sizes`)."""
