"""What a stage shows while it trains: the stage reporter (`reporter`, the core loop's callbacks: a facade over
the stage run's `metrics` writer, the checkpoint `registrar` and the `progress_updates`; what identifies a stage
in `identity`), the background threads they run on (`background`), Prefect progress and artifacts
(`progress`) and curves (`plots`)."""
