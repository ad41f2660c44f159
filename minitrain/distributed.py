"""Data-parallel training on ``torch.distributed``, launched by torchrun's elastic agent.

Every rank draws the whole global batch from the same generator and trains on its contiguous
shard; gradients are all-reduced in buckets between backward and update (gloo on CPU, NCCL on
CUDA). So a checkpoint does not depend on the rank count and N ranks follow one rank's
trajectory up to rounding.

>>> shard_sizes(5, 2)
[3, 2]
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from minitrain.atomic_io import write_atomic
from minitrain.errors import DistributedError, ExperimentError, ShardError, StorageError
from minitrain.tree import PyTree, leaves, named_leaves, nbytes, structure, unflatten

__all__ = [
    "DataParallel", "DistributedError", "LostPeer", "ShardError", "allreduce_sum",
    "check_splittable", "collective", "from_environment",
    "REPORTS_ENV", "gradient_bytes", "in_worker", "leave_report", "shard", "shard_sizes",
    "timeout_seconds",
]

# How long a collective may wait for the other ranks before it fails (not the agent's job).
DEFAULT_TIMEOUT_S = 120.0
TIMEOUT_ENV = "MINITRAIN_DIST_TIMEOUT"
# Set by ``--nproc`` for its workers: the folder where a worker leaves what the launcher must
# tell the user (``<kind>-<rank>``), so the job ends with one line naming the root cause.
REPORTS_ENV = "MINITRAIN_LAUNCH_REPORTS"


class LostPeer(DistributedError):
    """A collective failed because another rank went away or stopped answering (it died, was
    killed, or timed out): a consequence, whose cause the launcher names if it knows it."""

    lost_peer = True


def in_worker() -> bool:
    """Whether torchrun (or ``--nproc``) started this process: ``RANK`` and ``WORLD_SIZE`` set."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def leave_report(kind: str, text: str, rank: int | None = None) -> bool:
    """Write ``text`` as ``<kind>-<rank>`` (default ``RANK``) into the ``--nproc`` launcher's
    reports folder (aside, renamed); False when not started by ``--nproc`` or it failed."""
    folder = os.environ.get(REPORTS_ENV)
    rank = str(os.environ.get("RANK", "") if rank is None else rank)
    if not folder or not rank.isdigit():
        return False
    try:
        write_atomic(Path(folder) / f"{kind}-{rank}", text.rstrip("\n") + "\n")
    except StorageError:
        return False
    return True


def timeout_seconds(environ: dict[str, str] | None = None) -> float:
    """Seconds a collective waits for the other ranks: ``MINITRAIN_DIST_TIMEOUT`` or 120."""
    text = (os.environ if environ is None else environ).get(TIMEOUT_ENV, "")
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={text!r}: expected a positive number of seconds")
    return value


def shard_sizes(examples: int, world_size: int) -> list[int]:
    """Examples per rank in contiguous, near-equal shards (as ``torch.tensor_split``).

    >>> shard_sizes(8, 2), shard_sizes(7, 3)
    ([4, 4], [3, 2, 2])
    """
    if world_size < 1:
        raise ShardError(f"world_size must be >= 1, got {world_size}")
    if examples < world_size:
        raise ShardError(
            f"a global batch of {examples} examples cannot be split over {world_size} ranks; "
            f"use a batch of at least {world_size} (--set batch_size=...) or fewer ranks"
        )
    base, extra = divmod(examples, world_size)
    return [base + (r < extra) for r in range(world_size)]


def batch_size(batch: PyTree) -> int:
    """The leading dimension shared by every tensor of ``batch``."""
    sizes = {tuple(t.shape[:1]) for t in leaves(batch) if isinstance(t, torch.Tensor)}
    if not sizes or () in sizes or len(sizes) > 1:
        found = ", ".join(str(s[0]) if s else "0-d" for s in sorted(sizes)) or "no tensors"
        raise ShardError(
            f"data parallelism splits every batch tensor along dim 0, but the batch has leading "
            f"dims {found}; return tensors that share their first (batch) dimension"
        )
    return sizes.pop()[0]


def shard(batch: PyTree, rank: int, world_size: int) -> PyTree:
    """Rank ``rank``'s contiguous slice (a view) of every tensor of the global ``batch``.

    >>> [shard(torch.arange(6), r, 3).tolist() for r in range(3)]
    [[0, 1], [2, 3], [4, 5]]
    """
    if not 0 <= rank < world_size:
        raise ShardError(f"rank must be in [0, {world_size}), got {rank}")
    sizes = shard_sizes(batch_size(batch), world_size)
    start, stop = sum(sizes[:rank]), sum(sizes[:rank + 1])
    pieces = [t[start:stop] if isinstance(t, torch.Tensor) else t for t in leaves(batch)]
    return unflatten(structure(batch), pieces)


def allreduce_sum(tensors: Sequence[torch.Tensor], group: Any = None) -> list[torch.Tensor]:
    """The element-wise sum of ``tensors`` over all ranks, as new tensors: one flat buffer and
    one all-reduce per dtype and device. (DDP's buckets overlap the all-reduce with the
    backward pass; ``torch.func`` returns every grad at once, so there is nothing to overlap.)"""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [t.clone() for t in tensors]
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault((tensor.dtype, tensor.device), []).append(index)
    flats = [torch.cat([tensors[i].reshape(-1) for i in members]) for members in groups.values()]
    with collective("the gradient all-reduce"):
        works = [dist.all_reduce(flat, group=group, async_op=True) for flat in flats]  # SUM
        for work in works:
            work.wait()
    out = list(tensors)
    for members, flat in zip(groups.values(), flats, strict=True):
        pieces = flat.split([tensors[i].numel() for i in members])
        for i, piece in zip(members, pieces, strict=True):
            out[i] = piece.view_as(tensors[i])
    return out


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """A failed collective (a lost peer, a timeout) is a :class:`LostPeer` naming it."""
    try:
        yield
    except RuntimeError as exc:  # torch.distributed.DistBackendError is one
        cause = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise LostPeer(f"{what} failed: another worker stopped or lost contact ({cause})") from exc


class DataParallel:
    """This rank's share of a data-parallel run: sharding, the gradient all-reduce, agreement.

    ``reduce`` (the step's ``grad_transform``) averages grads, loss and aux over ranks, each
    weighted by its shard of the global batch.

    >>> dp = DataParallel(rank=0, world_size=1, device=torch.device("cpu"))
    >>> dp.reduce({"w": torch.ones(2)}, torch.tensor(3.0), {})
    ({'w': tensor([1., 1.])}, tensor(3.), {})
    """

    def __init__(self, rank: int, world_size: int, device: torch.device, group: Any = None
                 ) -> None:
        self.rank, self.world_size, self.device, self.group = rank, world_size, device, group
        self.weight = 1.0 / world_size  # this rank's share of the global batch
        self.reduce_seconds, self.reduce_calls, self.reduced_bytes = 0.0, 0, 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def backend(self) -> str:
        return str(dist.get_backend(self.group)) if dist.is_initialized() else "none"

    def shard(self, batch: PyTree) -> PyTree:
        """This rank's slice of the global ``batch``; sets the weight of its gradients."""
        examples = batch_size(batch)
        self.weight = shard_sizes(examples, self.world_size)[self.rank] / examples
        return shard(batch, self.rank, self.world_size)

    def reduce(
        self, grads: PyTree, loss: torch.Tensor, aux: dict[str, torch.Tensor]
    ) -> tuple[PyTree, torch.Tensor, dict[str, torch.Tensor]]:
        """Grads, loss and aux averaged over ranks (weighted by shard size), one all-reduce."""
        start = time.perf_counter()
        grad_leaves = leaves(grads)
        tensor_at = [i for i, leaf in enumerate(grad_leaves) if isinstance(leaf, torch.Tensor)]
        scalars = torch.stack([loss.detach().float(), *(v.detach().float() for v in aux.values())])
        weighted = [grad_leaves[i] * self.weight for i in tensor_at]
        weighted.append(scalars.to(self.device) * self.weight)
        summed = allreduce_sum(weighted, self.group)
        new_leaves = list(grad_leaves)
        for i, reduced in zip(tensor_at, summed, strict=False):
            new_leaves[i] = reduced
        mean_scalars = summed[-1].to(scalars.device)
        new_aux = {key: mean_scalars[1 + j].to(v.dtype) for j, (key, v) in enumerate(aux.items())}
        self.reduce_seconds += time.perf_counter() - start
        self.reduce_calls += 1
        self.reduced_bytes = sum(t.numel() * t.element_size() for t in weighted)
        return unflatten(structure(grads), new_leaves), mean_scalars[0].to(loss.dtype), new_aux

    def _all_max(self, value: torch.Tensor, what: str) -> torch.Tensor:
        with collective(what):
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return value

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (so every rank stops at the same step)."""
        flags = torch.tensor([int(flag)], device=self.device)
        return bool(self._all_max(flags, "agreeing on a stop").item())

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise max of ``tensor`` over the ranks, in a new tensor (fp8 amax
        histories: every rank then scales by the same amaxes)."""
        return self._all_max(tensor.clone(), "reducing the fp8 amax histories")

    def check_same(self, value: int, what: str) -> None:
        """Raise :class:`DistributedError` unless ``value`` is the same on every rank."""
        both = torch.tensor([value, -value], device=self.device)
        both = self._all_max(both, f"comparing {what} across ranks")
        high, low = int(both[0]), -int(both[1])
        if high != low:
            raise DistributedError(
                f"the ranks disagree on {what} ({low} to {high}; rank {self.rank} has {value}); "
                "every rank must see the same --out directory (a shared filesystem)"
            )

    def check_params(self, params: PyTree) -> None:
        """Raise :class:`ExperimentError` naming the first leaf whose name, shape, dtype or
        values differ between ranks (a rank-dependent init would train the ranks apart)."""
        named = [(name, leaf.detach()) for name, leaf in named_leaves(params)]
        layout = [f"{name!r} of shape {tuple(t.shape)} and {t.dtype}" for name, t in named]
        layouts: list[Any] = [None] * self.world_size
        with collective("comparing the params across ranks"):
            dist.all_gather_object(layouts, layout, group=self.group)
        for rank, other in enumerate(layouts):
            for mine, theirs in itertools.zip_longest(layouts[0], other, fillvalue="no leaf"):
                if mine != theirs:
                    raise ExperimentError(
                        f"init(generator) gave rank 0 {mine} but rank {rank} {theirs}; every "
                        "rank must create the same params (draw them from the generator only)")
        for name, leaf in named:  # equal on every rank iff max(x) == -max(-x)
            both = self._all_max(torch.stack([leaf, -leaf]).to(self.device),
                                 "comparing the params across ranks")
            if not torch.allclose(both[0], -both[1], rtol=0, atol=0, equal_nan=True):
                raise ExperimentError(
                    f"init(generator) gave the ranks different values at {name!r}; every rank "
                    "must create the same params (draw them from the generator only)")

    def barrier(self) -> None:
        """Wait for every rank (bounded by the process group's timeout)."""
        dist.barrier(group=self.group)

    def communication(self, gradient_bytes: int) -> dict[str, Any]:
        """Bytes all-reduced per step (predicted for a ring, and as sent here) and time spent."""
        from minitrain.accounting.flops import allreduce_bytes

        seconds = self.reduce_seconds / self.reduce_calls if self.reduce_calls else None
        ring = allreduce_bytes(gradient_bytes, self.world_size)
        return {
            "ranks": self.world_size,
            "process_group": self.backend,
            "gradient_bytes": gradient_bytes,
            "allreduce_bytes_per_rank": ring,
            "formula": "ring all-reduce: 2·(N-1)/N × gradient bytes per rank",
            "buffer_bytes": self.reduced_bytes,
            "reduce_seconds_per_step": seconds,
            "bus_bandwidth": ring / seconds if seconds else None,
        }

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def gradient_bytes(params: PyTree) -> int:
    """Bytes of the gradient pytree all-reduced each step: as many as the float params."""
    return nbytes(
        [p for p in leaves(params) if isinstance(p, torch.Tensor) and p.is_floating_point()]
    )


def from_environment(device: torch.device | str) -> DataParallel | None:
    """Join the process group described by torchrun's variables; None outside a worker."""
    if not in_worker():
        return None
    device = torch.device(device)
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_seconds())
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
    return DataParallel(dist.get_rank(), dist.get_world_size(), device)


def check_splittable(experiment: Any, backend: Any, nproc: int) -> None:
    """Raise ``ValueError`` unless ``experiment``'s batches can be split over ``nproc`` ranks
    on ``backend`` (one batch is drawn from a throwaway generator to see its size)."""
    device = torch.device(backend.device)
    if device.type == "cuda" and nproc > torch.cuda.device_count():
        raise ShardError(
            f"--nproc {nproc} needs {nproc} CUDA devices, this machine has "
            f"{torch.cuda.device_count()}; pass --nproc {max(torch.cuda.device_count(), 1)}"
        )
    shard_sizes(batch_size(experiment.next_batch(torch.Generator().manual_seed(0))), nproc)
