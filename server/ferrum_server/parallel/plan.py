"""What rank 0 tells the other ranks, as tensors: one fixed header, then an int64 payload.

Rank 0 owns every decision (validation, the KV manager, capacity, sampling); the followers
only repeat what touches their shard of the weights and of the KV pool: each forward and each
block copy, swap-out, swap-in or swap drop, in the order rank 0 made them. Every such
operation is one header broadcast (``HEADER_LEN`` int64: the op and its sizes) followed, when it
has one, by one payload broadcast (a flat int64 tensor): two collectives, no pickled Python
objects, the same on gloo (CPU) and NCCL (GPU tensors).

A forward's payload carries only what the runner's inputs are derived from (token ids, each
item's start offset, context lengths, block tables, the rows whose logits are computed); both
sides derive the positions and slot mapping with the same code (``ForwardPlan.inputs``).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from ferrum_kernels.attention import AttentionMetadata, OutputRows
from ferrum_kernels.transfer import ints_to_device

from ferrum_server.parallel.group import TensorParallel

HEADER_LEN = 8


class Op(enum.IntEnum):
    FORWARD = 1
    COPY_BLOCKS = 2  # payload: sources then targets
    SWAP_OUT = 3  # header[1]: swap key; payload: block ids
    SWAP_IN = 4  # header[1]: swap key; payload: block ids
    SWAP_DROP = 5  # payload: swap keys
    HEARTBEAT = 6  # no payload; followed by a one-element all-reduce (both sides see a death)
    STOP = 7  # rank 0 is shutting down cleanly


@dataclass(frozen=True, slots=True)
class ForwardPlan:
    """One forward, as the runner derives its inputs (identical on every rank)."""

    token_ids: torch.Tensor  # [T] int64
    query_start: list[int]  # [B + 1]
    offsets: list[int]  # [B] position of each item's first token
    context_lens: list[int]  # [B]
    block_tables: torch.Tensor  # [B, width] int64, rows padded with block 0
    output_rows: torch.Tensor  # [R] int64 flat token rows that go through the LM head
    # [B] how many of each item's last rows those are (host): the same rows, per item
    output_counts: list[int]

    def inputs(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input ids, positions, attention metadata) for the model."""
        device = self.token_ids.device
        b, t = len(self.offsets), self.token_ids.shape[0]
        if t == b and device.type == "cpu":  # one row per item: a decode-only step
            return self._one_row_inputs(block_size)
        return self._general_inputs(block_size)

    def _general_inputs(
        self, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``inputs`` for any plan, on any device, in torch ops."""
        device = self.token_ids.device
        b, t = len(self.offsets), self.token_ids.shape[0]
        # One copy that never waits for the device (`to_device`): counts, starts, offsets.
        per_item = ints_to_device(
            [
                *(end - start for start, end in itertools.pairwise(self.query_start)),
                *self.query_start[:-1],
                *self.offsets,
            ],
            device,
        )
        counts, starts, offsets = per_item[:b], per_item[b : 2 * b], per_item[2 * b :]  # [B]
        # output_size: without it the op reads the counts' sum back from the device.
        item_of_token = torch.repeat_interleave(
            torch.arange(b, device=device), counts, output_size=t
        )  # [T]
        positions = (
            torch.arange(self.token_ids.shape[0], device=device)
            - starts[item_of_token]
            + offsets[item_of_token]
        )  # [T]
        block_of_token = self.block_tables[item_of_token, positions // block_size]  # [T]
        slot_mapping = block_of_token * block_size + positions % block_size  # [T]
        meta = AttentionMetadata.build(
            self.query_start, self.context_lens, self.block_tables, slot_mapping
        )
        return self.token_ids, positions, meta

    def _one_row_inputs(
        self, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``inputs`` where every item has one row (row i is item i) and the tables are on the
        host: positions are the offsets, and each slot one lookup in the block table, in numpy.
        The general path's torch ops, each on a few dozen elements, made ``inputs`` take 154 us
        for 64 decodes of W1's model, this path 75 us (``tests/unit/test_forward_plan.py``
        holds the two equal)."""
        offsets = np.asarray(self.offsets, dtype=np.int64)  # [B]
        table = self.block_tables.numpy()
        blocks = table[np.arange(len(offsets)), offsets // block_size]  # IndexError past a row
        slot_mapping = torch.from_numpy(blocks * block_size + offsets % block_size)
        meta = AttentionMetadata.build(
            self.query_start, self.context_lens, self.block_tables, slot_mapping
        )
        return self.token_ids, torch.from_numpy(offsets), meta

    def outputs(self, meta: AttentionMetadata) -> OutputRows | None:
        """The output rows as the model takes them (``OutputRows``; ``meta`` from ``inputs``),
        or None when every row is one (a decode-only step): the model then finishes them all."""
        if self.output_rows.shape[0] == self.token_ids.shape[0]:
            return None
        return OutputRows.select(meta, self.output_counts, self.output_rows)


def _header(op: Op, *values: int) -> list[int]:
    return [int(op), *values] + [0] * (HEADER_LEN - 1 - len(values))


class PlanSender:
    """Rank 0's side: each operation the followers must repeat, broadcast in order. Every call
    comes from the engine thread (the one thread that runs forwards), so the order is the
    order the operations ran in on rank 0."""

    def __init__(
        self,
        tp: TensorParallel,
        device: torch.device,
        on_failure: Callable[[BaseException], object] = lambda exc: None,
    ) -> None:
        self.tp = tp
        # Collectives move tensors on the group's device: NCCL needs GPU tensors.
        self.device = device
        # Told first when a broadcast fails: the group is then unusable for good.
        self.on_failure = on_failure

    def _send(self, header: list[int], payload: list[int] | torch.Tensor | None = None) -> None:
        try:
            head = torch.tensor(header, dtype=torch.int64, device=self.device)
            dist.broadcast(head, src=0, group=self.tp.group)
            if payload is not None:
                body = torch.as_tensor(payload, dtype=torch.int64, device=self.device)
                dist.broadcast(body, src=0, group=self.tp.group)
        except Exception as exc:
            self.on_failure(exc)
            raise

    def forward(self, plan: ForwardPlan) -> None:
        batch, width = plan.block_tables.shape
        tokens, rows = plan.token_ids.shape[0], plan.output_rows.shape[0]
        payload = torch.cat(
            [
                plan.token_ids.to(self.device),
                torch.tensor(
                    plan.query_start + plan.offsets + plan.context_lens,
                    dtype=torch.int64,
                    device=self.device,
                ),
                plan.block_tables.reshape(-1).to(self.device),
                plan.output_rows.to(self.device),
            ]
        )
        self._send(_header(Op.FORWARD, tokens, batch, width, rows), payload)

    def copy_blocks(self, sources: list[int], targets: list[int]) -> None:
        self._send(_header(Op.COPY_BLOCKS, len(sources)), sources + targets)

    def swap_out(self, key: int, blocks: list[int]) -> None:
        self._send(_header(Op.SWAP_OUT, key, len(blocks)), blocks)

    def swap_in(self, key: int, blocks: list[int]) -> None:
        self._send(_header(Op.SWAP_IN, key, len(blocks)), blocks)

    def swap_drop(self, keys: list[int]) -> None:
        if keys:
            self._send(_header(Op.SWAP_DROP, len(keys)), keys)

    def heartbeat(self) -> None:
        """Prove every rank is alive: a collective that fails (at once when a peer's process
        is gone, after the group's timeout when it hangs) if any is not."""
        self._send(_header(Op.HEARTBEAT))
        try:
            dist.all_reduce(torch.ones(1, device=self.device), group=self.tp.group)
        except Exception as exc:
            self.on_failure(exc)
            raise

    def stop(self) -> None:
        self._send(_header(Op.STOP))


@dataclass(frozen=True, slots=True)
class Received:
    """One operation as a follower received it."""

    op: Op
    header: list[int]
    payload: torch.Tensor | None  # int64 on the group's device


class PlanReceiver:
    """A follower's side: the next operation rank 0 broadcast (blocks until it comes, or
    raises when the group's timeout passes or rank 0 is gone)."""

    def __init__(self, tp: TensorParallel, device: torch.device) -> None:
        self.tp = tp
        self.device = device
        self._head = torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)

    def next(self) -> Received:
        dist.broadcast(self._head, src=0, group=self.tp.group)
        header = self._head.tolist()
        op = Op(header[0])
        size = _payload_size(op, header)
        payload = None
        if size:
            payload = torch.empty(size, dtype=torch.int64, device=self.device)
            dist.broadcast(payload, src=0, group=self.tp.group)
        if op == Op.HEARTBEAT:
            dist.all_reduce(torch.ones(1, device=self.device), group=self.tp.group)
        return Received(op, header, payload)


def _payload_size(op: Op, header: list[int]) -> int:
    if op == Op.FORWARD:
        tokens, batch, width, rows = header[1:5]
        return tokens + (batch + 1) + 2 * batch + batch * width + rows
    if op == Op.COPY_BLOCKS:
        return 2 * header[1]
    if op in (Op.SWAP_OUT, Op.SWAP_IN):
        return header[2]
    if op == Op.SWAP_DROP:
        return header[1]
    return 0


def forward_plan(received: Received) -> ForwardPlan:
    """The forward a FORWARD operation describes (payload as ``PlanSender.forward`` packs it)."""
    assert received.op == Op.FORWARD and received.payload is not None
    tokens, batch, width, rows = received.header[1:5]
    parts = torch.split(received.payload, [tokens, 3 * batch + 1, batch * width, rows])
    # One read back to the host (a device sync on a GPU) for everything the host needs.
    small = torch.cat((parts[1], parts[3])).tolist()
    query_start = small[: batch + 1]
    return ForwardPlan(
        token_ids=parts[0],
        query_start=query_start,
        offsets=small[batch + 1 : 2 * batch + 1],
        context_lens=small[2 * batch + 1 : 3 * batch + 1],
        block_tables=parts[2].reshape(batch, width),
        output_rows=parts[3],
        output_counts=output_counts(query_start, small[3 * batch + 1 :]),
    )


def output_counts(query_start: list[int], rows: list[int]) -> list[int]:
    """How many of each item's rows are among ``rows`` (each item's trailing rows, in item
    order, as the runner picks them)."""
    counts = [0] * (len(query_start) - 1)
    item = 0
    for row in rows:
        while row >= query_start[item + 1]:
            item += 1
        counts[item] += 1
    return counts
