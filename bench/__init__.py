"""Benchmarks and studies, apart from the pipeline: `timing/` the rows of `make bench` (bench/run.py, each against
its anchor in the same run), `studies/` what the other Makefile targets run (demo-seeds, rlvr, tools,
async-rollouts, served-rewards) and the GPU run, `helpers/` what both use. Each runs from the repository root as
`python -m bench.<folder>.<module>`; results go to bench/results.json, bench/results.md and bench/results/."""
