"""``TensorParallel``: which rank of how many this process is, and its collectives.

A model is built for one ``TensorParallel`` (``SINGLE_RANK`` unless told otherwise); its
parallel layers ask it for the two collectives they need. Both are torch.distributed calls on
the description's process group (gloo on CPU, NCCL on GPU), and both are no-ops, returning
their input, at world size 1, so a single-rank model runs exactly the code it ran before
tensor parallelism existed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(slots=True)
class CollectiveClock:
    """Time this rank spent in collectives since the last ``take``: wall time on CPU (gloo
    collectives block), CUDA event time on GPU (NCCL runs on the stream, asynchronously)."""

    cpu_ns: int = 0
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)

    def take(self) -> int:
        """Nanoseconds accumulated, and start again (waits for the GPU events to complete)."""
        total = self.cpu_ns
        for start, end in self.events:
            end.synchronize()
            total += int(start.elapsed_time(end) * 1e6)
        self.cpu_ns, self.events = 0, []
        return total


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's place in a tensor-parallel group."""

    rank: int
    world_size: int
    # The group the collectives run over; None is torch.distributed's default group (and is
    # never touched at world size 1, where nothing needs initialising).
    group: dist.ProcessGroup | None = None
    clock: CollectiveClock = field(default_factory=CollectiveClock, compare=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"tensor-parallel world size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"tensor-parallel rank must be in [0, {self.world_size}), got {self.rank}"
            )

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_default_group(cls) -> TensorParallel:
        """This process in torch.distributed's default group (``init_process_group`` done)."""
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size())

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        if self.world_size > 1:
            self._timed(x, lambda: dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group))
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order (``x`` at world size 1)."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._timed(x, lambda: dist.all_gather(parts, x, group=self.group))
        return torch.cat(parts, dim=dim)

    def agree_min(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's ``value`` (e.g. the KV blocks every rank can hold)."""
        if self.world_size == 1:
            return value
        x = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.group)
        return int(x.item())

    def gather_ints(self, values: list[int], device: torch.device) -> list[list[int]]:
        """Every rank's ``values`` (the same length on each), in rank order."""
        x = torch.tensor(values, dtype=torch.int64, device=device)
        rows: list[list[int]] = self.all_gather(x.unsqueeze(0), dim=0).tolist()
        return rows

    def _timed(self, x: torch.Tensor, collective: Callable[[], object]) -> None:
        if x.is_cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            collective()
            end.record()
            self.clock.events.append((start, end))
            return
        began = time.perf_counter_ns()
        collective()
        self.clock.cpu_ns += time.perf_counter_ns() - began


# The description of a model that is not split: every collective is a no-op.
SINGLE_RANK = TensorParallel(rank=0, world_size=1)


def collective_backend(device: torch.device) -> str:
    """The torch.distributed backend for ranks on ``device``: NCCL between GPUs, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"
