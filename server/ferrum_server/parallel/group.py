"""``TensorParallel``: which rank of how many this process is, and its collectives.

A model is built for one ``TensorParallel`` (``SINGLE_RANK`` unless told otherwise); its
parallel layers ask it for the two collectives they need. Both are torch.distributed calls on
the description's process group (gloo on CPU, NCCL on GPU), and both are no-ops, returning
their input, at world size 1, so a single-rank model runs exactly the code it ran before
tensor parallelism existed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's place in a tensor-parallel group."""

    rank: int
    world_size: int
    # The group the collectives run over; None is torch.distributed's default group (and is
    # never touched at world size 1, where nothing needs initialising).
    group: dist.ProcessGroup | None = None

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
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order (``x`` at world size 1)."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)


# The description of a model that is not split: every collective is a no-op.
SINGLE_RANK = TensorParallel(rank=0, world_size=1)


def collective_backend(device: torch.device) -> str:
    """The torch.distributed backend for ranks on ``device``: NCCL between GPUs, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"
