"""What the benchmarks share: the anchor libraries and the harness that runs each side in its own process
(`anchors`), TRL's side of the speed rows (`trl_sides`), and the scaling grid's prepared models and measured
runs (`scaling_sides`) with its data-parallel worker (`scaling_worker`, run as a script under torchrun)."""
