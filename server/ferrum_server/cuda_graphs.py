"""CUDA graphs of the decode-only forward, one per batch-size bucket.

A decode step is dominated by launch overhead at small batches: a few hundred small kernels
whose host-side cost exceeds their device time. Capturing the whole forward (embedding, every
layer, final norm and LM head) once per bucket and replaying it removes that cost.

How a decode-only step of B items runs here:

* B is rounded up to the smallest captured bucket; the padding rows are dummies that write
  their K/V into a *scratch block* no sequence owns and attend to it alone (context length 1),
  so they never touch live KV and never divide by zero.
* The step's inputs go into static device buffers (token ids, positions, slot mapping, context
  lengths, block tables padded to the widest table the model allows) with one small host ->
  device copy per buffer, then the bucket's graph replays and the first B rows of the static
  logits buffer are the result. Sampling stays eager.
* Steps with prefill chunks or verify items, and decode steps above the largest bucket, run
  eagerly as before.

The graph object sits behind `GraphCapturer`/`Graph` so the bucket, padding and static-buffer
logic also runs on CPU: `EagerCapturer` "replays" by calling the captured function again over
the same static buffers, which is what a CUDA graph does minus the launch savings.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from ferrum_kernels.attention import AttentionMetadata, DecodeAttentionFn, DecodeBatch
from ferrum_kernels.backend import KernelBackend, WriteKvFn

from ferrum_server.device_tokens import DeviceToken, place_device_tokens
from ferrum_server.kv.block_table import padded_block_table
from ferrum_server.models import CausalLM

DEFAULT_MAX_BATCH = 256
# Rows of the static scalar input buffer.
_TOKEN, _POSITION, _SLOT, _CONTEXT = range(4)


def graph_batch_sizes(max_batch: int) -> tuple[int, ...]:
    """Buckets up to max_batch: 1, 2, 4, 8, then every 16 up to 256, then every 32.

    Small batches get tight buckets (they are where launch overhead dominates); beyond 8 a
    padding of up to 15 (31) rows costs little next to the weight reads every step pays anyway.
    max_batch itself is always a bucket.
    """
    if max_batch < 1:
        raise ValueError(f"the largest CUDA graph batch must be >= 1, got {max_batch}")
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch]
    size = 16
    while size <= max_batch:
        sizes.append(size)
        size += 16 if size < 256 else 32
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return tuple(sizes)


def bucket_for(batch_size: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds batch_size, or None when it is above the largest."""
    index = bisect.bisect_left(sizes, batch_size)
    return sizes[index] if index < len(sizes) else None


# -- graph objects --------------------------------------------------------------------------


class Graph(Protocol):
    def replay(self) -> None: ...


class GraphCapturer(Protocol):
    def capture(self, fn: Callable[[], None]) -> Graph:
        """Record fn (which reads and writes only static tensors) for later replays."""
        ...


class CudaGraphCapturer:
    """Real CUDA graphs in one shared memory pool (capture the largest bucket first, so the
    smaller ones reuse its activation memory)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def capture(self, fn: Callable[[], None]) -> Graph:
        # Warm-up outside capture: Triton compiles its kernels and cuBLAS creates its handles
        # and workspaces on first use, and neither may happen while a graph is recording.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            fn()
        return graph


class _EagerGraph:
    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn

    def replay(self) -> None:
        self._fn()


class EagerCapturer:
    """Stand-in for CPU tests: 'replay' calls the captured function again on the same static
    buffers, so everything but the CUDA graph itself is exercised."""

    def capture(self, fn: Callable[[], None]) -> Graph:
        fn()  # like a capture-time warm-up: the function must run on the static buffers as-is
        return _EagerGraph(fn)


def graph_capturer_for(device: torch.device) -> GraphCapturer | None:
    """Real graphs on CUDA; None elsewhere (decode then runs eagerly)."""
    return CudaGraphCapturer(device) if device.type == "cuda" else None


# -- decode graphs --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DecodeGraphLayout:
    """Fixed shapes of the graphs: what the static buffers must hold."""

    block_size: int
    max_blocks_per_sequence: int  # width W of the static block tables
    scratch_block: int  # a pool block no sequence uses: padding rows write and read only it
    batch_sizes: tuple[int, ...]  # ascending buckets

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    @property
    def scratch_slot(self) -> int:
        return self.scratch_block * self.block_size


class _BoundAttention:
    """An AttentionFn for a captured decode forward: the backend's KV write at the metadata's
    slot mapping (the static slot row), then the graph-safe decode attention over the static
    buffers (the rest of the per-step metadata is ignored)."""

    def __init__(self, write_kv: WriteKvFn, attend: DecodeAttentionFn) -> None:
        self._write_kv = write_kv
        self._attend = attend

    def __call__(
        self,
        query: torch.Tensor,  # [B, H, D]
        key: torch.Tensor,  # [B, Hkv, D]
        value: torch.Tensor,  # [B, Hkv, D]
        kv_layer: torch.Tensor,  # [2, NB, BS, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        # Written before attending so each new token sees its own K/V.
        self._write_kv(kv_layer, key, value, meta.slot_mapping)
        return self._attend(query, kv_layer, scale, window, softcap)


class DecodeGraphs:
    """Static buffers, one captured decode forward per bucket, and the replay path."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,  # [L, 2, NB, BS, Hkv, D]
        layout: DecodeGraphLayout,
        backend: KernelBackend,
        capturer: GraphCapturer,
    ) -> None:
        if backend.decode_attention is None:
            raise ValueError(f"the {backend.name} kernels have no graph-safe decode attention")
        if not 0 <= layout.scratch_block < kv_cache.shape[2]:
            raise ValueError(f"scratch block {layout.scratch_block} is outside the KV pool")
        self.model = model
        self.kv_cache = kv_cache
        self.layout = layout
        self.backend = backend
        self.capturer = capturer
        config = model.config
        self.vocab_size = config.vocab_size
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        device = kv_cache.device
        bmax, width = layout.max_batch, layout.max_blocks_per_sequence
        # Static device buffers: every graph reads views of these, so their addresses are fixed.
        self.inputs = torch.zeros((4, bmax), dtype=torch.int64, device=device)  # rows _TOKEN..
        self.tables = torch.full(
            (bmax, width), layout.scratch_block, dtype=torch.int64, device=device
        )  # [Bmax, W]
        self.context_lens = torch.ones(bmax, dtype=torch.int32, device=device)  # [Bmax]
        self.logits = torch.zeros((bmax, self.vocab_size), dtype=torch.float32, device=device)
        # Host staging: pinned on CUDA so the copies are true async DMA.
        pin = device.type == "cuda"
        self._host_inputs = torch.zeros((4, bmax), dtype=torch.int64, pin_memory=pin)
        self._host_tables = torch.zeros(bmax * width, dtype=torch.int64, pin_memory=pin)
        self._host_inputs[_SLOT] = layout.scratch_slot  # unused rows stay harmless padding
        self._host_inputs[_CONTEXT] = 1
        # Set after each step's copies: the next step must not overwrite the pinned staging
        # while a copy may still be reading it.
        self._copied: torch.cuda.Event | None = None
        self.graphs: dict[int, Graph] = {}
        # Per bucket: the captured function. A CUDA graph holds raw device addresses, not
        # references, so everything the function closes over must outlive the graph: the
        # metadata the model sees and the decode attention's index tensors (built outside
        # capture by the ordinary allocator). Dropped, their memory goes back to the allocator
        # and the replays read whatever is put there next.
        self._captured: dict[int, Callable[[], None]] = {}

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.graphs))

    # -- capture --------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self, sizes: tuple[int, ...] | None = None) -> None:
        """Capture the given buckets (default: all), largest first."""
        self._stage_padding(self.layout.max_batch)
        for size in sorted(sizes or self.layout.batch_sizes, reverse=True):
            if size not in self.layout.batch_sizes:
                raise ValueError(f"{size} is not one of the buckets {self.layout.batch_sizes}")
            if size not in self.graphs:
                forward = self._forward_fn(size)
                self.graphs[size] = self.capturer.capture(forward)
                self._captured[size] = forward

    def _forward_fn(self, size: int) -> Callable[[], None]:
        """The function captured for one bucket: only static views, no host values."""
        layout = self.layout
        tables = self.tables[:size]  # [B, W]
        context_lens = self.context_lens[:size]  # [B] int32
        batch = DecodeBatch(tables, context_lens, layout.block_size)
        assert self.backend.decode_attention is not None
        attend = self.backend.decode_attention(batch, self.num_heads, self.num_kv_heads)
        kernels = replace(self.backend, attention=_BoundAttention(self.backend.write_kv, attend))
        token_ids = self.inputs[_TOKEN, :size]  # [B]
        positions = self.inputs[_POSITION, :size]  # [B]
        slots = self.inputs[_SLOT, :size]  # [B], contiguous (a row of the [4, Bmax] buffer)
        contexts = self.inputs[_CONTEXT, :size]  # [B] int64
        # Built here, outside capture (it copies host lists to the device). Attention ignores
        # it (the bound kernel reads the static buffers); the KV write uses its slot_mapping,
        # which is the static slot row. The host context lengths are upper bounds only.
        max_context = batch.max_context
        meta = AttentionMetadata.build(list(range(size + 1)), [max_context] * size, tables, slots)
        logits = self.logits[:size]  # [B, V]
        model, kv_cache = self.model, self.kv_cache

        def forward() -> None:
            context_lens.copy_(contexts)  # int64 -> int32 on the device, inside the graph
            # The graph's kernels for this forward only (a host-side swap, so a captured graph
            # keeps them); eager steps go on with the model's own backend, whose weights are
            # already prepared (binding it again changes nothing).
            eager = model.backend
            model.bind_backend(kernels)
            try:
                hidden = model(token_ids, positions, kv_cache, meta)  # [B, hidden]
            finally:
                model.bind_backend(eager)
            logits.copy_(model.compute_logits(hidden))  # [B, V] float32

        return forward

    # -- replay ---------------------------------------------------------------------------

    def accepts(self, batch_size: int, max_blocks: int) -> bool:
        """Whether a decode step of this size and widest block table can replay a graph."""
        return (
            bucket_for(batch_size, self.batch_sizes) is not None
            and max_blocks <= self.layout.max_blocks_per_sequence
        )

    @torch.inference_mode()
    def run(
        self,
        token_ids: list[int],
        positions: list[int],
        block_tables: list[list[int]],
        device_tokens: dict[int, DeviceToken] | None = None,
    ) -> torch.Tensor:
        """Logits [B, V] float32 of a decode step: one token per item at `positions`; the
        items in `device_tokens` take theirs from the device instead of `token_ids`.

        The result is a view of the static logits buffer: valid until the next `run`.
        """
        count = len(token_ids)
        size = bucket_for(count, self.batch_sizes)
        if size is None:
            raise ValueError(f"no CUDA graph holds a batch of {count}")
        width = max(len(row) for row in block_tables)
        if width > self.layout.max_blocks_per_sequence:
            raise ValueError(f"a block table of {width} blocks is wider than the graphs")
        self._stage(token_ids, positions, block_tables, size, width)
        if device_tokens:  # after the staging copy in stream order, so these rows win
            place_device_tokens(self.inputs[_TOKEN], device_tokens)
        self.graphs[size].replay()
        return self.logits[:count]

    def _wait_for_staging(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def _stage(
        self,
        token_ids: list[int],
        positions: list[int],
        block_tables: list[list[int]],
        size: int,
        width: int,
    ) -> None:
        """Fill the static buffers: B real rows, then size - B padding rows."""
        layout = self.layout
        bs, scratch = layout.block_size, layout.scratch_block
        count = len(token_ids)
        pad = size - count
        slots = [
            table[p // bs] * bs + p % bs for table, p in zip(block_tables, positions, strict=True)
        ]
        rows = [
            [*token_ids, *[0] * pad],
            [*positions, *[0] * pad],
            [*slots, *[layout.scratch_slot] * pad],
            [*(p + 1 for p in positions), *[1] * pad],
        ]
        self._wait_for_staging()
        self._host_inputs[:, :size] = torch.tensor(rows, dtype=torch.int64)  # [4, size]
        staged = self._host_tables[: size * width].view(size, width)
        # Unused columns point at the scratch block too (never read: contexts mask them).
        staged[:count].copy_(padded_block_table(block_tables, width, scratch))  # [B, width]
        staged[count:].fill_(scratch)  # padding rows: [pad, width]
        # The whole [4, Bmax] buffer in one contiguous copy (a few KB; rows past `size` are
        # stale and unread). Of the tables only the columns in use: stale ones are never read.
        self.inputs.copy_(self._host_inputs, non_blocking=True)
        self.tables[:size, :width].copy_(staged, non_blocking=True)
        if self.inputs.device.type == "cuda":
            self._copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._copied.record()

    def _stage_padding(self, size: int) -> None:
        """Make every row a padding row (what capture-time warm-ups run on)."""
        layout = self.layout
        self._wait_for_staging()
        self.inputs[_TOKEN, :size] = 0
        self.inputs[_POSITION, :size] = 0
        self.inputs[_SLOT, :size] = layout.scratch_slot
        self.inputs[_CONTEXT, :size] = 1
        self.tables[:size].fill_(layout.scratch_block)
        self.context_lens[:size] = 1
