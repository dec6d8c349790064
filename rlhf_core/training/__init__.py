"""The one training-loop skeleton every stage runs (`loop`: resume, cadence, evaluation, the run of a stage's
step), built on the engine a step calls (`engine`: accelerator, optimizer and schedule, accumulation,
clipping, the non-finite policy), with its checkpoints (`checkpointing`) and log window (`metric_window`);
optimizer and schedule (`optimization`), seeds (`determinism`), per-phase timing (`timing`) and data
parallelism (`parallel`). The SFT stage's math (`sft`) is the simplest user of it."""
