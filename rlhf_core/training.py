"""Temporary re-exports while the loop moves (removed before the refactor lands)."""

from rlhf_core.loop import *  # noqa: F401,F403
from rlhf_core.loop import ShardedBatches, build_optimizer, disable_dropout, epoch_batches, make_accelerator, seed_everything  # noqa: F401
from rlhf_core.saving import *  # noqa: F401,F403
from rlhf_core.saving import apply_umask, assert_finite, atomic_dir, is_peft, restore_weights, save_hf_dir, save_pretrained_atomic  # noqa: F401
