"""The KV pool's tensor and the block-level copies made on it outside a forward.

The KV manager decides which blocks hold what; this module moves their contents: copies
between blocks (copy-on-write of a shared prefix block), and swaps to and from host memory
(preemption). Under tensor parallelism every rank holds its own heads of every block, so each
such move on rank 0 is also sent to the followers (``PlanSender``), which repeat it on their
shard; a swap is named by a key so each rank keeps its own host copy and drops it when rank 0
drops its own.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ferrum_server.parallel.plan import PlanSender


@dataclass(frozen=True, slots=True)
class HostKv:
    """Blocks' contents parked in host memory: rank 0's shard, and the key the other ranks
    keep theirs under."""

    key: int
    tensor: torch.Tensor  # [L, 2, num_blocks, block_size, kv_heads, head_dim] on the CPU

    @property
    def num_blocks(self) -> int:
        return int(self.tensor.shape[2])

    @property
    def num_bytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class KvStorage:
    """The pool tensor [L, 2, num_blocks (+ reserved), block_size, kv_heads, head_dim]."""

    def __init__(self, tensor: torch.Tensor, followers: PlanSender | None = None) -> None:
        self.tensor = tensor
        self.followers = followers  # None on one rank, and on the followers themselves
        self._keys = itertools.count(1)

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes in this rank's pool (its heads only)."""
        return self.tensor[:, :, 0].numel() * self.tensor.element_size()

    def _index(self, blocks: list[int]) -> torch.Tensor:
        return torch.tensor(blocks, dtype=torch.int64, device=self.tensor.device)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (source, target) block's contents, in order."""
        if not pairs:
            return
        if self.followers is not None:
            self.followers.copy_blocks([s for s, _ in pairs], [t for _, t in pairs])
        for source, target in pairs:
            self.tensor[:, :, target].copy_(self.tensor[:, :, source])

    def swap_out(self, blocks: list[int], key: int = 0) -> HostKv:
        """Copy the blocks' contents to host memory (under a new key unless given one)."""
        key = key or next(self._keys)
        if self.followers is not None:
            self.followers.swap_out(key, blocks)
        return HostKv(key, self.tensor.index_select(2, self._index(blocks)).to("cpu"))

    def swap_in(self, host: HostKv, blocks: list[int]) -> None:
        """Copy parked contents back into `blocks` (as many as were parked); the host copy is
        spent (every rank drops its own)."""
        blocks = blocks[: host.num_blocks]
        if self.followers is not None:
            self.followers.swap_in(host.key, blocks)
        self.tensor.index_copy_(2, self._index(blocks), host.tensor.to(self.tensor.device))

    def drop(self, hosts: list[HostKv]) -> None:
        """Host copies rank 0 no longer keeps: the followers drop theirs too."""
        if self.followers is not None:
            self.followers.swap_drop([host.key for host in hosts])
