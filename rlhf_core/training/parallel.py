"""What the training loops need to run unchanged under DDP, DeepSpeed ZeRO and FSDP.

- `reduce_metrics`: the logged numbers of all processes in one collective (means, totals, minima, maxima).
- `full_parameters`: parameters whole on every process for generation and evaluation, which run
  outside the prepared module's training forward (ZeRO-3 and FSDP keep one shard per process).
- `gathered_state_dicts`: the full weights of the trained models for a checkpoint, gathered on
  every process (a collective) and written by the main one.
- `from_main`, `all_gather_objects`: Python objects across processes (a decision taken where the
  evaluation ran, acted on everywhere; what each process sees of the shared storage);
  `portable_error` makes an exception fit to be broadcast.
- `make_accelerator`: the Accelerator of a stage, from run.device and run.mixed_precision.

Under DDP (and on one process) each of these is a no-op or a plain `state_dict()`. All of them are
collective: every process must call them at the same point of the loop.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch


def uses_deepspeed(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def shards_parameters(accelerator) -> bool:
    """True under DeepSpeed ZeRO-3 and FSDP: no process holds every parameter between forwards."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        return True
    return kind == DistributedType.DEEPSPEED and accelerator.state.deepspeed_plugin.zero_stage == 3


def shards_optimizer(accelerator) -> bool:
    """True under DeepSpeed (any ZeRO stage) and FSDP: each process holds a part of the optimizer state."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP)


def reduce_metrics(
    accelerator,
    metrics: Mapping[str, float | torch.Tensor],
    sums: Iterable[str] = (),
    mins: Iterable[str] = (),
    maxes: Iterable[str] = (),
) -> dict[str, float]:
    """The metrics of every process in one collective: the mean of each key, the total for keys in
    `sums`, the smallest for `mins`, the largest for `maxes`.

    Values may be floats or 0-d tensors (left on the device until here, so the loop never waits on
    them); one transfer brings them all back. On one process this is just that transfer.
    """
    keys = list(metrics)
    if not keys:
        return {}
    device = accelerator.device
    dtype = torch.float32 if device.type == "mps" else torch.float64
    values = torch.stack([torch.as_tensor(metrics[k], dtype=dtype, device=device).detach().reshape(()) for k in keys])
    world = accelerator.num_processes
    if world > 1:
        low, high = set(mins), set(maxes)
        if low or high:  # a gather (min and max are not sums); still one collective
            every = accelerator.gather(values.unsqueeze(0)).view(world, -1)
            totals, means = every.sum(0), every.mean(0)
            values = torch.stack(
                [
                    every[:, i].min()
                    if k in low
                    else every[:, i].max()
                    if k in high
                    else totals[i]
                    if k in set(sums)
                    else means[i]
                    for i, k in enumerate(keys)
                ]
            )
        else:
            values = accelerator.reduce(values, reduction="sum")
            totals = set(sums)
            scale = torch.tensor([1.0 if k in totals else 1.0 / world for k in keys], dtype=dtype, device=device)
            values = values * scale
    return dict(zip(keys, values.tolist()))


@contextmanager
def full_parameters(accelerator, prepared: torch.nn.Module) -> Iterator[None]:
    """Inside the block every parameter of `prepared` is whole on every process.

    ZeRO-3: gathered once (`deepspeed.zero.GatheredParameters`) instead of per module and per token.
    FSDP2: every sharded module unsharded and kept so until the block ends (no resharding after each
    forward), so a generation loop whose length differs between processes issues no collective.
    Elsewhere: nothing to do. Every process must enter, even one that only waits.
    """
    if not shards_parameters(accelerator):
        yield
        return
    if uses_deepspeed(accelerator):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(prepared.parameters()), modifier_rank=None):
            yield
        return
    if not accelerator.is_fsdp2:
        raise RuntimeError(
            "FSDP version 1 is not supported; set fsdp_version: 2 in the accelerate config "
            "(configs/accelerate/fsdp.yaml does)"
        )
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in prepared.modules() if isinstance(m, FSDPModule)]
    for module in sharded:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield
    finally:
        for module in sharded:
            module.reshard()
            # FSDP keeps the root unsharded after forward (backward needs it at once); the others reshard
            module.set_reshard_after_forward(module is not sharded[0], recurse=False)


def gathered_state_dicts(
    accelerator, prepared: torch.nn.Module, models: Mapping[str, torch.nn.Module]
) -> dict[str, dict] | None:
    """Under parameter sharding: {name: full state dict} of each model in `models` (sub-modules of
    `prepared`), complete on the main process. Without sharding: None (save the modules as they are).

    Collective: every process calls it; accelerate gathers the weights (ZeRO-3 needs
    `zero3_save_16bit_model: true`, which configs/accelerate/deepspeed_zero3.yaml sets).
    """
    if not shards_parameters(accelerator):
        return None
    full = accelerator.get_state_dict(prepared)
    root = accelerator.unwrap_model(prepared)
    prefixes = {}
    for name, model in models.items():
        found = [prefix for prefix, module in root.named_modules() if module is model]
        if not found:
            raise ValueError(f"the {name} model is not part of the trained module")
        prefixes[name] = f"{found[0]}." if found[0] else ""
    if not accelerator.is_main_process:
        return {name: {} for name in models}
    return {name: {k[len(p) :]: v for k, v in full.items() if k.startswith(p)} for name, p in prefixes.items()}


def from_main(obj: Any) -> Any:
    """`obj` as the main process (rank 0) holds it, on every process: a broadcast of its pickle.

    Collective when torch.distributed is initialized with more than one process (every process calls it
    at the same point; the others' `obj` is ignored); otherwise `obj` itself. Works after the Accelerator
    that set up the process group is gone (the group outlives it).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_objects(obj: Any) -> list[Any]:
    """Every process's `obj`, in rank order, on every process (`[obj]` on one process); a collective."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def make_accelerator(
    run,  # a RunConfig (config imports this module)
    gradient_accumulation_steps: int = 1,
    *,
    micro_batch_size: int | None = None,
    max_grad_norm: float | None = None,
):
    """An Accelerator honouring run.device and run.mixed_precision (launch-time settings win).

    Under DeepSpeed, `micro_batch_size` and `max_grad_norm` fill the engine's "auto" batch size and
    clipping: the loops prepare no DataLoader from which accelerate could read them.
    """
    from accelerate import Accelerator

    accelerator = Accelerator(
        cpu=run.device == "cpu",
        mixed_precision=run.mixed_precision,
        gradient_accumulation_steps=gradient_accumulation_steps,
    )
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        ds = plugin.deepspeed_config
        if micro_batch_size is not None and ds.get("train_micro_batch_size_per_gpu", "auto") == "auto":
            ds["train_micro_batch_size_per_gpu"] = micro_batch_size
        if max_grad_norm is not None and ds.get("gradient_clipping", "auto") == "auto":
            ds["gradient_clipping"] = max_grad_norm
    return accelerator


def portable_error(error: Exception | None) -> Exception | None:
    """`error` when it survives a pickle round trip (what a broadcast does to it), else a RuntimeError that
    says what the main process raised."""
    if error is None:
        return None
    try:
        if type(pickle.loads(pickle.dumps(error))) is type(error):
            return error
    except Exception:  # noqa: BLE001 (an exception that does not pickle is described instead)
        pass
    return RuntimeError(f"the evaluating process (rank 0) failed: {type(error).__name__}: {error}")


def use_cpu_threads(threads: int | None) -> None:
    """run.cpu_threads: torch's intra-op threads for this process (null leaves torch's default)."""
    if threads is not None:
        torch.set_num_threads(threads)
