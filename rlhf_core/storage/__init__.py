"""What a run writes to disk: checkpoints and their pickle-free training state (`checkpoints`), atomic
directories and Hugging Face saves (`saving`), which directories a run may write (`ownership`), and the
proof that every node sees the run directory (`shared`)."""
