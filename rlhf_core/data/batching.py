"""The order in which a stage reads its rows: epoch shuffles fixed by (seed, epoch), shared out over
data-parallel processes, resumable at the saved epoch and position; and how a batch is cut into micro-batches, by rows
or by a token budget."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhf_core.data.rows import DataValidationError


def epoch_batches(n_rows: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """The batches of one epoch: a permutation fixed by (seed, epoch), incomplete tail dropped.

    With the epoch and the position inside it saved, a resumed run sees exactly the same data order.
    """
    order = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
    size = min(batch_size, n_rows)
    return [order[i : i + size] for i in range(0, n_rows - size + 1, size)]


class ShardedBatches:
    """Data-parallel batch order: each optimizer step consumes `world` consecutive batches of the
    epoch's permutation and process `rank` takes the `rank`-th one (different data on every
    process, the same order on one process). With world 1 this is `epoch_batches` in order.

    `epoch` and `position` are what a checkpoint saves to resume the exact order.
    """

    def __init__(
        self, n_rows: int, batch_size: int, seed: int, *, rank: int, world: int, epoch: int = 0, position: int = 0
    ):
        self.n_rows, self.batch_size, self.seed, self.rank, self.world = n_rows, batch_size, seed, rank, world
        self.epoch, self.position = epoch, position
        self.batches = epoch_batches(n_rows, batch_size, seed, epoch)
        if len(self.batches) < world:
            raise DataValidationError(
                f"{n_rows} rows make {len(self.batches)} batches of {batch_size}, fewer than the "
                f"{world} processes that each need one per step; lower the batch size or add data"
            )

    def next(self) -> list[int]:
        """This process's batch for the next step."""
        indices = self.batches[self.position + self.rank]
        self.position += self.world
        if self.position + self.world > len(self.batches):
            self.epoch, self.position = self.epoch + 1, 0
            self.batches = epoch_batches(self.n_rows, self.batch_size, self.seed, self.epoch)
        return indices

    @property
    def fraction(self) -> float:
        return self.epoch + self.position / max(len(self.batches), 1)


class LoaderCycle:
    """A DataLoader read for ever: `next()` gives the next batch, a new epoch (a new shuffle) after the last."""

    def __init__(self, loader):
        self.loader, self.iterator = loader, iter(loader)

    def next(self):
        try:
            return next(self.iterator)
        except StopIteration:
            self.iterator = iter(self.loader)
            return next(self.iterator)


class Grouped:
    """`count` batches of `source` per `next()` (a step's micro-batches); its epoch and position pass through."""

    def __init__(self, source, count: int):
        self.source, self.count = source, count

    def next(self) -> list:
        return [self.source.next() for _ in range(self.count)]

    def __getattr__(self, name: str):  # epoch, position, fraction
        return getattr(self.source, name)


def micro_batch_plan(
    lengths: Sequence[int], rows: int, max_tokens: int | None = None, *, count: int = 0
) -> list[list[int]]:
    """The micro-batches of positions 0..len(lengths)-1, rows of `lengths` tokens each: runs of `rows` positions in
    order; with `max_tokens` (a token budget, verl's dynamic batch size), positions packed longest first so that each
    micro-batch's size x its longest row stays within the budget (a row longer than it alone). Then the largest
    micro-batch is halved until there are `count` (data-parallel processes run as many forwards), as far as rows go.
    """
    n = len(lengths)
    if max_tokens is None:
        plan = [list(range(start, min(start + rows, n))) for start in range(0, n, rows)]
    else:
        plan, current = [], []
        for i in sorted(range(n), key=lambda i: -lengths[i]):  # stable: equal lengths keep their order
            if current and (len(current) + 1) * lengths[current[0]] > max_tokens:
                plan.append(sorted(current))
                current = []
            current.append(i)
        plan += [sorted(current)] if current else []
    while len(plan) < count and any(len(micro) > 1 for micro in plan):
        at = max(range(len(plan)), key=lambda k: len(plan[k]))
        micro = plan[at]
        plan[at : at + 1] = [micro[: len(micro) // 2], micro[len(micro) // 2 :]]
    return plan
