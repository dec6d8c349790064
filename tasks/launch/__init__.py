"""Beyond one process: the stage tasks call `launcher` (a credential-free spec, then torchrun / accelerate
launch, or `ray_driver`'s Ray Train TorchTrainer); every process runs `worker`, which imports the stage body
the spec names."""
