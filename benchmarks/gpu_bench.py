"""GPU benchmark on a Llama-3-8B-shaped model with random bf16 weights built on the device.

Sections (each printed as a table row and stored in the JSON written to ``--out``):

* ``rates``: measured device-to-device copy bandwidth (a large tensor copy; reads + writes) and
  bf16 matmul throughput (a large square GEMM). These are the floors the model is judged against.
* ``kernels``: torch reference vs Triton for decode attention (with the step's KV write, as a
  layer runs it; incl. a split-K long-context case) and for sampling over the full vocabulary
  (greedy, top-p).
* ``split_sweep``: the Triton decode attention at every forced KV split count, beside the
  split heuristic's choice, for each attention case (CUDA only).
* ``decode``: one decode step (forward + LM head + greedy sample) at batch 1/8/64/256 with ~512
  tokens of context each, against the weight-read floor = weight bytes / copy bandwidth (and the
  same floor including the KV bytes the step must read); eager and replayed from a CUDA graph
  (``graph_step_ms``, and the replay alone, ``graph_replay_ms``; on the CPU dry run the graph is
  an eager stand-in).
* ``profile``: torch.profiler over a few decode steps, eager and graph-replayed, at the smallest
  and largest batch: wall time per step, the device's busy time (its kernels' own time summed)
  and the ops taking the most device and host time. The engine section profiles a few of its
  steady-state decode steps the same way (``engine.profile_decode_steps``).
* ``prefill``: tokens/s of a fresh 8192-token prefill step, against the floor set by the
  measured GEMM rate for the step's matmul FLOPs.
* ``engine``: offline throughput through the in-process ``Engine`` with a simple continuous
  batching loop (decodes first, then chunked prefill up to the token budget), greedy; on CUDA
  the engine sizes its own KV pool (measured activations and CUDA graphs) and decode steps
  replay its graphs (``graph_steps``). ``steps_by_kind`` splits the steps that held prefill
  chunks from decode-only ones, with the engine's own forward / sampling / total time.
* ``memory_plan``: how that engine divided device memory (total, budget, weights, peak
  activations, CUDA graphs reserved / measured, KV pool).

* ``tensor_parallel`` (only with ``--tensor-parallel-size N``, N > 1): the same model split over N
  GPUs (``ferrum_server.parallel``, NCCL; on the CPU dry run N gloo processes), one process per
  rank started by this script on cuda:0..N-1. Eager decode steps at every batch and the prefill
  step, each row labelled with its ``tp`` size, beside the same steps at TP=1 on cuda:0, and the
  time of the step's collectives alone (2 all-reduces per layer, the embedding's all-reduce and
  the logits' all-gather, at the step's shapes). Needs N visible GPUs; with fewer it says so and
  exits 2. In this mode the kernel and engine sections are skipped (both are single-device: the
  in-process engine takes one injected model), and so are CUDA graphs.

The model runs whatever kernels ``ferrum_server`` wires in; the ``backend`` field records what
``select_backend`` picks on this device. ``--dry-run`` runs every code path on CPU with a tiny
config in seconds (used by tests/unit/test_gpu_bench_dry_run.py).

    python benchmarks/gpu_bench.py --out bench.json
    python benchmarks/gpu_bench.py --out bench-tp2.json --tensor-parallel-size 2
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from ferrum_kernels.attention import AttentionMetadata, reference_decode_attention
from ferrum_kernels.backend import KernelBackend, select_backend
from ferrum_kernels.sampling import SamplingTensors, build_sampling_tensors
from ferrum_server import engine as engine_module
from ferrum_server import startup
from ferrum_server.config import EngineConfig
from ferrum_server.cuda_graphs import (
    DecodeGraphLayout,
    DecodeGraphs,
    EagerCapturer,
    GraphCapturer,
    bucket_for,
    graph_batch_sizes,
    graph_capturer_for,
)
from ferrum_server.domain import ItemKind, ItemStatus, Step, StepItem, StepOutcome, Timings
from ferrum_server.models import LlamaForCausalLM, ModelConfig, tiny_config
from ferrum_server.parallel import SINGLE_RANK, TensorParallel, collective_backend
from ferrum_server.parallel.sharding import vocab_shard

GIB = 1024**3


def llama3_8b_config() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=None,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
        bos_token_id=128000,
        eos_token_ids=(128001,),
    )


@dataclass(frozen=True)
class Plan:
    """Sizes of every section: the real run and the seconds-long CPU dry run."""

    device: torch.device
    dtype: torch.dtype
    config: ModelConfig
    block_size: int
    copy_bytes: int
    gemm_n: int
    decode_batches: tuple[int, ...]
    decode_context: int
    prefill_items: tuple[int, ...]  # prompt length of each item of the prefill step
    attn_cases: tuple[tuple[int, int], ...]  # (batch, context) for the attention microbench
    sample_rows: int
    engine_requests: int
    engine_input: tuple[int, int]  # mean, +- spread (uniform)
    engine_output: int
    engine_batch_tokens: int
    engine_batch_size: int
    iters: int
    warmup: int
    extra: dict[str, Any] = field(default_factory=dict)


def real_plan(args: argparse.Namespace) -> Plan:
    return Plan(
        device=torch.device("cuda"),
        dtype=torch.bfloat16,
        config=llama3_8b_config(),
        block_size=16,
        copy_bytes=4 * GIB,
        gemm_n=8192,
        decode_batches=(1, 8, 64, 256),
        decode_context=512,
        prefill_items=(2048, 2048, 2048, 2048),
        attn_cases=((1, 32768), (64, 512), (256, 512)),
        sample_rows=256,
        engine_requests=args.requests,
        engine_input=(512, 256),
        engine_output=128,
        engine_batch_tokens=8192,
        engine_batch_size=256,
        iters=20,
        warmup=3,
    )


def dry_plan(args: argparse.Namespace) -> Plan:
    return Plan(
        device=torch.device("cpu"),
        dtype=torch.float32,
        config=tiny_config(),
        block_size=4,
        copy_bytes=8 * 1024**2,
        gemm_n=128,
        decode_batches=(1, 4),
        decode_context=24,
        prefill_items=(20, 12),
        attn_cases=((2, 40),),
        sample_rows=4,
        engine_requests=min(args.requests, 12),
        engine_input=(16, 8),
        engine_output=4,
        engine_batch_tokens=64,
        engine_batch_size=8,
        iters=2,
        warmup=1,
    )


# ----------------------------------------------------------------------------------------------
# Timing helpers
# ----------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_it(fn: Callable[[], object], plan: Plan, iters: int | None = None) -> float:
    """Mean seconds per call after warm-up (device-synchronised)."""
    for _ in range(plan.warmup):
        fn()
    _sync(plan.device)
    n = iters or plan.iters
    start = time.perf_counter()
    for _ in range(n):
        fn()
    _sync(plan.device)
    return (time.perf_counter() - start) / n


class StepProfiler:
    """torch.profiler over a few steps, summarised small enough for the JSON report: per step,
    the wall time, the device's busy time (the kernels' own time, summed: below the wall time
    when the host or launches leave the device idle) and the host's, and the ops that take the
    most of each. On CPU only the host side is recorded."""

    def __init__(self, device: torch.device, top: int = 12) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.device = device
        self.top = top
        self._profile = profile(activities=activities)
        self._steps = 0
        self._wall = 0.0

    def start(self) -> StepProfiler:
        _sync(self.device)
        self._profile.start()
        self._started = time.perf_counter()
        return self

    def step(self) -> None:
        self._steps += 1

    @property
    def steps(self) -> int:
        return self._steps

    def stop(self) -> dict[str, Any]:
        _sync(self.device)
        self._wall = time.perf_counter() - self._started
        self._profile.stop()
        return self.summary()

    def summary(self) -> dict[str, Any]:
        n = max(self._steps, 1)
        events = list(self._profile.key_averages())

        def top(attr: str) -> list[dict[str, Any]]:
            ranked = sorted(events, key=lambda e: getattr(e, attr), reverse=True)
            return [
                {
                    "op": e.key[:96],
                    "calls_per_step": e.count / n,
                    "us_per_step": getattr(e, attr) / n,
                }
                for e in ranked[: self.top]
                if getattr(e, attr) > 0
            ]

        return {
            "steps": self._steps,
            "wall_ms_per_step": self._wall / n * 1e3,
            "device_busy_ms_per_step": sum(e.self_device_time_total for e in events) / n / 1e3,
            "host_op_ms_per_step": sum(e.self_cpu_time_total for e in events) / n / 1e3,
            "top_device": top("self_device_time_total"),
            "top_host": top("self_cpu_time_total"),
        }


def profile_steps(fn: Callable[[], object], plan: Plan, steps: int = 5) -> dict[str, Any]:
    """StepProfiler's summary of ``steps`` calls of fn after the plan's warm-up calls."""
    for _ in range(plan.warmup):
        fn()
    prof = StepProfiler(plan.device).start()
    for _ in range(steps):
        fn()
        prof.step()
    return prof.stop()


# ----------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------


def _time_copy(plan: Plan) -> float:
    # A function of its own so both buffers are freed before the GEMM allocates.
    src = torch.empty(plan.copy_bytes // 2, dtype=torch.bfloat16, device=plan.device).fill_(1.0)
    dst = torch.empty_like(src)
    return time_it(lambda: dst.copy_(src), plan)


def measure_rates(plan: Plan) -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second) and dense GEMM FLOP/s."""
    copy_s = _time_copy(plan)
    n = plan.gemm_n
    gemm_dtype = torch.bfloat16 if plan.device.type == "cuda" else torch.float32
    a = torch.randn(n, n, dtype=gemm_dtype, device=plan.device)
    b = torch.randn(n, n, dtype=gemm_dtype, device=plan.device)
    gemm_s = time_it(lambda: a @ b, plan)
    return {
        "copy_bandwidth_gbps": 2 * plan.copy_bytes / copy_s / 1e9,
        "gemm_tflops": 2 * n**3 / gemm_s / 1e12,
    }


def build_model(plan: Plan, tp: TensorParallel = SINGLE_RANK) -> LlamaForCausalLM:
    """Random weights straight on the device: the nn.Linear/nn.Embedding default initialisers
    run in place at construction, norms start at ones. ``tp``: build only that rank's shard."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(plan.config, dtype=plan.dtype, device=plan.device, tp=tp)
    return model.requires_grad_(False).eval()


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    elem = torch.empty(0, dtype=dtype).element_size()
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * elem


def make_kv_cache(plan: Plan, num_blocks: int, kv_heads: int = 0) -> torch.Tensor:
    """kv_heads: a rank's KV heads (``model.kv_heads``); 0 = all of the model's."""
    c = plan.config
    heads = kv_heads or c.num_kv_heads
    shape = (c.num_layers, 2, num_blocks, plan.block_size, heads, c.head_dim)
    return torch.zeros(shape, dtype=plan.dtype, device=plan.device)


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    out_rows: torch.Tensor  # [B] last row of every item
    tables: list[list[int]]  # host block table of every item


def make_batch(plan: Plan, items: list[tuple[int, int]], vocab: int) -> Batch:
    """items: (history, new tokens); item i owns a contiguous run of blocks."""
    bs, dev = plan.block_size, plan.device
    query_start, context_lens, tables, slots, positions = [0], [], [], [], []
    next_block = 0
    width = max(math.ceil((h + n) / bs) for h, n in items)
    for hist, n in items:
        ctx = hist + n
        blocks = list(range(next_block, next_block + math.ceil(ctx / bs)))
        next_block += len(blocks)
        tables.append(blocks + [0] * (width - len(blocks)))
        query_start.append(query_start[-1] + n)
        context_lens.append(ctx)
        for p in range(hist, ctx):
            positions.append(p)
            slots.append(blocks[p // bs] * bs + p % bs)
    t = query_start[-1]
    meta = AttentionMetadata.build(
        query_start,
        context_lens,
        torch.tensor(tables, dtype=torch.int64, device=dev),
        torch.tensor(slots, dtype=torch.int64, device=dev),
    )
    return Batch(
        input_ids=torch.randint(0, vocab, (t,), device=dev),
        positions=torch.tensor(positions, dtype=torch.int64, device=dev),
        meta=meta,
        out_rows=torch.tensor(query_start[1:], device=dev) - 1,
        tables=[row[: math.ceil(c / bs)] for row, c in zip(tables, context_lens, strict=True)],
    )


def blocks_for(plan: Plan, items: list[tuple[int, int]]) -> int:
    return sum(math.ceil((h + n) / plan.block_size) for h, n in items)


@torch.inference_mode()
def run_step(
    model: LlamaForCausalLM, kv: torch.Tensor, batch: Batch, backend: KernelBackend
) -> torch.Tensor:
    hidden = model(batch.input_ids, batch.positions, kv, batch.meta)  # [T, hidden]
    logits = model.compute_logits(hidden[batch.out_rows])  # [B, V]
    params = SamplingTensors.greedy(logits.shape[0], logits.device)
    return backend.sample(logits, params).token_ids


def build_decode_graphs(
    plan: Plan, model: LlamaForCausalLM, kv: torch.Tensor, scratch_block: int
) -> DecodeGraphs:
    """Decode graphs over the benchmark's pool, captured for exactly the benchmarked batches.

    Real CUDA graphs on CUDA; on the CPU dry run an eager stand-in. Without a graph-safe decode
    kernel (no Triton) the torch reference stands in: the tables here are only as wide as the
    benchmark's contexts, so its full-width gather stays cheap.
    """
    backend = select_backend(plan.device)
    graph_backend = backend
    if backend.decode_attention is None:
        graph_backend = replace(backend, decode_attention=reference_decode_attention)
    capturer: GraphCapturer = graph_capturer_for(plan.device) or EagerCapturer()
    layout = DecodeGraphLayout(
        block_size=plan.block_size,
        max_blocks_per_sequence=math.ceil((plan.decode_context + 1) / plan.block_size),
        scratch_block=scratch_block,
        batch_sizes=graph_batch_sizes(max(plan.decode_batches)),
    )
    graphs = DecodeGraphs(model, kv, layout, graph_backend, capturer)
    graphs.capture(tuple(plan.decode_batches))
    return graphs


@torch.inference_mode()
def run_graph_step(graphs: DecodeGraphs, batch: Batch, backend: KernelBackend) -> torch.Tensor:
    logits = graphs.run(
        batch.input_ids.tolist(), batch.positions.tolist(), batch.tables
    )  # [B, V]; the host copies of inputs and tables are part of a real step too
    params = SamplingTensors.greedy(logits.shape[0], logits.device)
    return backend.sample(logits, params).token_ids


def bench_decode(
    plan: Plan,
    model: LlamaForCausalLM,
    kv: torch.Tensor,
    rates: dict[str, float],
    graphs: DecodeGraphs | None = None,
) -> list[dict[str, Any]]:
    backend = select_backend(plan.device)
    bw = rates["copy_bandwidth_gbps"] * 1e9
    w_bytes = weight_bytes(model)
    rows = []
    for batch_size in plan.decode_batches:
        items = [(plan.decode_context, 1)] * batch_size
        batch = make_batch(plan, items, plan.config.vocab_size)
        step_s = time_it(lambda batch=batch: run_step(model, kv, batch, backend), plan)
        graph_s = replay_s = 0.0
        if graphs is not None:
            graph_s = time_it(lambda batch=batch: run_graph_step(graphs, batch, backend), plan)
            # The replay alone, on the inputs the last step staged: the rest of graph_s is the
            # host staging, the input copies and the eager sampling.
            bucket = bucket_for(batch_size, graphs.batch_sizes)
            assert bucket is not None
            replay_s = time_it(graphs.graphs[bucket].replay, plan)
        kv_read = (
            batch_size * (plan.decode_context + 1) * kv_bytes_per_token(plan.config, plan.dtype)
        )
        floor = w_bytes / bw
        rows.append(
            {
                "batch": batch_size,
                "context": plan.decode_context + 1,
                "step_ms": step_s * 1e3,
                "weight_floor_ms": floor * 1e3,
                "weight_kv_floor_ms": (w_bytes + kv_read) / bw * 1e3,
                "vs_weight_floor": step_s / floor,
                "tokens_per_s": batch_size / step_s,
                **(
                    {
                        "graph_step_ms": graph_s * 1e3,
                        "graph_replay_ms": replay_s * 1e3,
                        "graph_speedup": step_s / graph_s,
                    }
                    if graph_s
                    else {}
                ),
            }
        )
    return rows


def matmul_flops(config: ModelConfig, items: list[tuple[int, int]]) -> float:
    """Matmul FLOPs of a prefill step: linear layers for every token, causal attention, LM head
    for the last token of each item."""
    c = config
    per_layer = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    per_layer += c.num_heads * c.head_dim * c.hidden_size
    per_layer += 3 * c.hidden_size * c.intermediate_size
    tokens = sum(n for _, n in items)
    flops = 2.0 * per_layer * c.num_layers * tokens
    for hist, n in items:
        # QK^T and PV, each 2 * H * D per (query, visible key) pair; ~half visible in the chunk.
        pairs = n * hist + n * (n + 1) / 2
        flops += 4.0 * c.num_heads * c.head_dim * pairs * c.num_layers
    flops += 2.0 * c.hidden_size * c.vocab_size * len(items)
    return flops


def bench_prefill(
    plan: Plan, model: LlamaForCausalLM, kv: torch.Tensor, rates: dict[str, float]
) -> dict[str, Any]:
    backend = select_backend(plan.device)
    items = [(0, n) for n in plan.prefill_items]
    batch = make_batch(plan, items, plan.config.vocab_size)
    step_s = time_it(lambda: run_step(model, kv, batch, backend), plan, max(2, plan.iters // 4))
    tokens = sum(plan.prefill_items)
    flops = matmul_flops(plan.config, items)
    floor = flops / (rates["gemm_tflops"] * 1e12)
    return {
        "tokens": tokens,
        "step_ms": step_s * 1e3,
        "tokens_per_s": tokens / step_s,
        "gemm_floor_ms": floor * 1e3,
        "fraction_of_gemm_rate": floor / step_s,
    }


def bench_profile(
    plan: Plan, model: LlamaForCausalLM, kv: torch.Tensor, graphs: DecodeGraphs | None
) -> dict[str, Any]:
    """Where a decode step's time goes, kernel by kernel: eager and graph-replayed at the
    smallest and largest batch (the graph rows are the whole step: staging, replay, sampling).
    With CUPTI the kernels inside a replay are recorded one by one."""
    backend = select_backend(plan.device)
    out: dict[str, Any] = {}
    for batch_size in sorted({min(plan.decode_batches), max(plan.decode_batches)}):
        batch = make_batch(plan, [(plan.decode_context, 1)] * batch_size, plan.config.vocab_size)
        out[f"decode_b{batch_size}_eager"] = profile_steps(
            lambda batch=batch: run_step(model, kv, batch, backend), plan
        )
        if graphs is not None:
            out[f"decode_b{batch_size}_graph"] = profile_steps(
                lambda batch=batch: run_graph_step(graphs, batch, backend), plan
            )
    return out


# Forced KV partition counts the split sweep times (those that leave each split at least four
# blocks of context).
SPLIT_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)
# (query, one layer's pool, metadata, scale, forced split count or None for the heuristic)
SplitAttend = Callable[
    [torch.Tensor, torch.Tensor, AttentionMetadata, float, "int | None"], torch.Tensor
]


def _triton_split_attend() -> SplitAttend | None:
    try:
        from ferrum_kernels.triton_attention import paged_attention_triton
    except ImportError:
        return None

    def attend(
        q: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata, scale: float, n: int | None
    ) -> torch.Tensor:
        return paged_attention_triton(q, kv, meta, scale, num_splits=n)

    return attend


def bench_split_sweep(plan: Plan, attend: SplitAttend | None = None) -> list[dict[str, Any]]:
    """Decode attention's time by forced KV split count at every attention case, beside the
    heuristic's own choice (``choose_num_splits``, set without a GPU): the data to set it from.
    The first H200 run read KV at 994 GB/s for one item of 32k and 833 GB/s for 64 items of
    512, against a 4.3 TB/s copy. Triton on CUDA (``attend`` stands in elsewhere); empty
    without it."""
    if attend is None:
        attend = _triton_split_attend() if plan.device.type == "cuda" else None
        if attend is None:
            return []
    c = plan.config
    scale = c.head_dim**-0.5
    rows: list[dict[str, Any]] = []
    for batch_size, context in plan.attn_cases:
        kv, batch, q, kv_bytes = _attention_case(plan, batch_size, context)
        row: dict[str, Any] = {"case": f"b={batch_size} ctx={context}"}
        row["heuristic_us"] = time_it(partial(attend, q, kv, batch.meta, scale, None), plan) * 1e6
        timed: dict[int, float] = {}
        for n in SPLIT_COUNTS:
            if n == 1 or context // n >= 4 * plan.block_size:
                timed[n] = time_it(partial(attend, q, kv, batch.meta, scale, n), plan) * 1e6
                row[f"s{n}_us"] = timed[n]
        best = min(timed, key=timed.__getitem__)
        row["best_splits"] = best
        row["best_kv_gbps"] = kv_bytes / (timed[best] / 1e6) / 1e9
        row["heuristic_kv_gbps"] = kv_bytes / (row["heuristic_us"] / 1e6) / 1e9
        rows.append(row)
    return rows


def _attention_case(
    plan: Plan, batch_size: int, context: int
) -> tuple[torch.Tensor, Batch, torch.Tensor, int]:
    """One layer's pool, the batch of ``batch_size`` decodes at ``context`` (this step's token
    included), their queries [B, H, D] and the KV bytes the attention must read."""
    c = plan.config
    items = [(context - 1, 1)] * batch_size
    kv = torch.randn(
        (2, blocks_for(plan, items), plan.block_size, c.num_kv_heads, c.head_dim),
        device=plan.device,
    ).to(plan.dtype)
    batch = make_batch(plan, items, c.vocab_size)
    q = torch.randn(batch_size, c.num_heads, c.head_dim, dtype=plan.dtype, device=plan.device)
    kv_bytes = kv_bytes_per_token(c, plan.dtype) // c.num_layers * batch_size * context
    return kv, batch, q, kv_bytes


def bench_kernels(plan: Plan) -> list[dict[str, Any]]:
    """Decode attention and sampling, torch reference vs Triton (CUDA only for Triton)."""
    c = plan.config
    rows: list[dict[str, Any]] = []
    backends = [("torch", select_backend(plan.device, prefer="torch"))]
    if plan.device.type == "cuda":
        try:
            backends.append(("triton", select_backend(plan.device, prefer="triton")))
        except RuntimeError as exc:
            rows.append({"kernel": "triton", "skipped": str(exc)})
    scale = c.head_dim**-0.5
    for batch_size, context in plan.attn_cases:
        kv, batch, q, kv_bytes = _attention_case(plan, batch_size, context)
        k, v = torch.randn(
            2, batch_size, c.num_kv_heads, c.head_dim, dtype=plan.dtype, device=plan.device
        )  # this step's K/V, written by the attention call
        row: dict[str, Any] = {"kernel": f"decode_attention b={batch_size} ctx={context}"}
        for name, backend in backends:
            s = time_it(partial(backend.attention, q, k, v, kv, batch.meta, scale), plan)
            row[f"{name}_us"] = s * 1e6
            row[f"{name}_kv_gbps"] = kv_bytes / s / 1e9
        rows.append(row)
    n, vocab = plan.sample_rows, c.vocab_size
    logits = torch.randn(n, vocab, device=plan.device) * 3
    cases = {
        "greedy": SamplingTensors.greedy(n, plan.device),
        "temperature": build_sampling_tensors(
            [0.8] * n,
            [0] * n,
            [1.0] * n,
            list(range(n)),
            [7] * n,
            [1.0] * n,
            None,
            None,
            0,
            vocab,
            plan.device,
        ),
        "top_p": build_sampling_tensors(
            [0.8] * n,
            [0] * n,
            [0.9] * n,
            list(range(n)),
            [7] * n,
            [1.0] * n,
            None,
            None,
            0,
            vocab,
            plan.device,
        ),
    }
    for case, params in cases.items():
        row = {"kernel": f"sample {case} n={n} V={vocab}"}
        for name, backend in backends:
            s = time_it(lambda backend=backend, params=params: backend.sample(logits, params), plan)
            row[f"{name}_us"] = s * 1e6
        if len(backends) == 2:
            same = torch.equal(
                backends[0][1].sample(logits, params).token_ids,
                backends[1][1].sample(logits, params).token_ids,
            )
            row["same_tokens"] = same
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------
# Tensor parallelism: the model split over N ranks (one process per GPU)
# ----------------------------------------------------------------------------------------------

# How long the rank processes may take, all sections together, before they are killed: the
# script must stay one command within the device run's 10 minutes.
SPLIT_DEADLINE_S = 300.0
SPLIT_DEADLINE_DRY_S = 180.0


def _collectives(plan: Plan, tp: TensorParallel, tokens: int, items: int) -> Callable[[], None]:
    """The communication of one forward of ``tokens`` tokens and ``items`` sampled rows, alone:
    the embedding's all-reduce, two per layer (o_proj, down_proj), the logits' all-gather."""
    c = plan.config
    hidden = torch.zeros(tokens, c.hidden_size, dtype=plan.dtype, device=plan.device)
    local_vocab = vocab_shard(c.vocab_size, tp.rank, tp.world_size).rows
    logits = torch.zeros(items, local_vocab, dtype=plan.dtype, device=plan.device)

    def run() -> None:
        for _ in range(2 * c.num_layers + 1):
            tp.all_reduce(hidden)
        tp.all_gather(logits)

    return run


def bench_split(plan: Plan, tp: TensorParallel) -> dict[str, list[dict[str, Any]]]:
    """This rank's eager decode and prefill step times (every rank runs the same calls; the
    collectives keep them in step), with the collectives' own time when split."""
    backend = select_backend(plan.device)
    model = build_model(plan, tp)
    model.bind_backend(backend)
    decode_items = [(plan.decode_context, 1)] * max(plan.decode_batches)
    prefill_items = [(0, n) for n in plan.prefill_items]
    num_blocks = max(blocks_for(plan, decode_items), blocks_for(plan, prefill_items))
    kv = make_kv_cache(plan, num_blocks, model.kv_heads)
    vocab = plan.config.vocab_size

    def row(kind: str, batch: Batch, items: int, iters: int | None = None) -> dict[str, Any]:
        step_s = time_it(lambda: run_step(model, kv, batch, backend), plan, iters)
        tokens = int(batch.input_ids.shape[0])
        out: dict[str, Any] = {"tp": tp.world_size, kind: items, "step_ms": step_s * 1e3}
        out["tokens_per_s"] = (items if kind == "batch" else tokens) / step_s
        if tp.is_parallel:
            comm_s = time_it(_collectives(plan, tp, tokens, items), plan, iters)
            out["collectives_ms"] = comm_s * 1e3
            out["collectives_share"] = comm_s / step_s
        return out

    decode = []
    for batch_size in plan.decode_batches:
        torch.manual_seed(1)  # the same token ids on every rank
        batch = make_batch(plan, [(plan.decode_context, 1)] * batch_size, vocab)
        decode.append(row("batch", batch, batch_size))
    torch.manual_seed(1)
    batch = make_batch(plan, prefill_items, vocab)
    prefill = row("prefill_tokens", batch, sum(plan.prefill_items), max(2, plan.iters // 4))
    prefill.pop("prefill_tokens")
    prefill = {"tokens": sum(plan.prefill_items), **prefill}
    return {"decode": decode, "prefill": [prefill]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def split_rank_main(args: argparse.Namespace) -> int:
    """One rank of the split benchmark (a process this script started): join the group, run
    ``bench_split``, rank 0 writes the rows to ``--split-result``."""
    rank, world = args.split_rank, args.tensor_parallel_size
    plan = dry_plan(args) if args.dry_run else real_plan(args)
    if plan.device.type == "cuda":
        torch.cuda.set_device(rank)
        plan = replace(plan, device=torch.device("cuda", rank))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        collective_backend(plan.device),
        init_method=args.split_init,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        rows = bench_split(plan, TensorParallel.from_default_group())
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(args.split_result).write_text(json.dumps(rows))
    return 0


def run_split_ranks(plan: Plan, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """Start ``world`` rank processes of this script (rank r on cuda:r), wait for them within
    the deadline (killing them past it), and return rank 0's rows."""
    deadline = SPLIT_DEADLINE_DRY_S if args.dry_run else SPLIT_DEADLINE_S
    init = f"tcp://127.0.0.1:{_free_port()}"
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo ranks (dry run) talk over loopback
    with tempfile.TemporaryDirectory(prefix="gpu-bench-tp-") as work:
        result = Path(work) / "rank0.json"
        common = [sys.executable, str(Path(__file__).resolve()), "--out", str(result)]
        common += ["--tensor-parallel-size", str(world), "--requests", str(args.requests)]
        common += ["--split-init", init, "--split-result", str(result)]
        common += ["--dry-run"] if args.dry_run else []
        logs = [Path(work) / f"rank{r}.log" for r in range(world)]
        procs = []
        for rank, log in enumerate(logs):
            with log.open("wb") as out:
                argv = [*common, "--split-rank", str(rank)]
                procs.append(subprocess.Popen(argv, env=env, stdout=out, stderr=out))
        ends = time.monotonic() + deadline
        try:
            while any(p.poll() is None for p in procs):
                failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed or time.monotonic() > ends:
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        codes = [p.returncode for p in procs]
        if any(codes) or not result.exists():
            tails = "\n".join(
                f"-- rank {r} (exit {c}):\n" + log.read_text(errors="replace")[-2000:]
                for r, (c, log) in enumerate(zip(codes, logs, strict=True))
            )
            raise RuntimeError(
                f"tensor-parallel ranks failed or passed the {deadline:.0f} s deadline "
                f"(exit codes {codes}):\n{tails}"
            )
        rows: dict[str, Any] = json.loads(result.read_text())
        return rows


def compare_split(baseline: dict[str, Any], split: dict[str, Any]) -> dict[str, Any]:
    """TP=1 and TP=N rows side by side, the TP=N rows with their speed-up over TP=1."""
    out: dict[str, Any] = {}
    for section in ("decode", "prefill"):
        rows = []
        for one, many in zip(baseline[section], split[section], strict=True):
            rows += [one, {**many, "speedup_vs_tp1": one["step_ms"] / many["step_ms"]}]
        out[section] = rows
    return out


def run_tensor_parallel(plan: Plan, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """TP=1 on the first device in this process, then TP=N in N rank processes."""
    baseline = bench_split(plan, SINGLE_RANK)
    if plan.device.type == "cuda":
        torch.cuda.empty_cache()  # rank 0 needs cuda:0's memory back
    report = {"size": world, **compare_split(baseline, run_split_ranks(plan, world, args))}
    _print_table(f"decode step, TP=1 vs TP={world} (context ~512; eager)", report["decode"])
    _print_table(f"prefill, TP=1 vs TP={world}", report["prefill"])
    return report


# ----------------------------------------------------------------------------------------------
# Offline throughput through the engine
# ----------------------------------------------------------------------------------------------


@dataclass(eq=False)  # identity semantics: `in` checks must not compare prompts
class Request:
    rid: str
    prompt: list[int]
    cache_id: str = ""
    # Prompt tokens in the cache (steps run one at a time), or in launched steps (launched
    # ahead, where the cache is known at launch).
    prefilled: int = 0
    generated: list[int] = field(default_factory=list)
    launched: int = 0  # outputs of launched steps (launched ahead)

    @property
    def committed(self) -> int:
        # Every generated token but the newest has been fed back and written.
        return self.prefilled + max(0, len(self.generated) - 1)


class Batches:
    """Continuous batching: every running request decodes, then chunked prefill fills the rest
    of the token budget. Admission reserves each request's final length in blocks up front, so
    no step is ever deferred for lack of KV.

    Steps run one at a time carry each decode's input token and learn the prompt's progress
    from the answers. Steps launched ahead (`Engine.launch` before the previous step finished)
    continue each decode from the token its cache selected and count progress at launch."""

    def __init__(self, plan: Plan, requests: list[Request], total_blocks: int) -> None:
        self.plan = plan
        self.total_blocks = total_blocks
        self.waiting = list(requests)
        self.running: list[Request] = []  # decoding
        self.prefilling: list[Request] = []  # admitted, prompt not fully cached yet
        self.reserved = 0

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def _need(self, req: Request) -> int:
        return math.ceil((len(req.prompt) + self.plan.engine_output) / self.plan.block_size)

    def next_step(self, ahead: bool) -> tuple[list[StepItem], list[Request]]:
        """The next step's items and the request of each (empty when nothing can run now)."""
        plan = self.plan
        items: list[StepItem] = []
        owners: list[Request] = []
        budget = plan.engine_batch_tokens
        for req in self.running:
            if len(items) == plan.engine_batch_size:
                break
            if not ahead:
                item = StepItem(
                    ItemKind.DECODE, req.rid, req.cache_id, [req.generated[-1]], req.committed
                )
            elif req.launched < plan.engine_output:
                position = req.prefilled + req.launched - 1
                item = StepItem(
                    ItemKind.DECODE, req.rid, req.cache_id, [], position, continuation=True
                )
                req.launched += 1
            else:
                continue  # its last token is in flight
            items.append(item)
            owners.append(req)
            budget -= 1
        while budget > 0 and len(items) < plan.engine_batch_size:
            # Partially prefilled requests continue before new ones are admitted.
            req = next((r for r in self.prefilling if r not in owners), None)
            if req is None:
                # Room for its blocks and a sequence slot: a request holds its cache until
                # released, which launched ahead is a step after its last one launched.
                if (
                    not self.waiting
                    or self.reserved + self._need(self.waiting[0]) > self.total_blocks
                    or len(self.running) + len(self.prefilling) >= plan.engine_batch_size
                ):
                    break
                self.reserved += self._need(self.waiting[0])
                req = self.waiting.pop(0)
                self.prefilling.append(req)
            chunk = req.prompt[req.prefilled : req.prefilled + budget]
            items.append(
                StepItem(
                    ItemKind.PREFILL_CHUNK,
                    req.rid,
                    req.cache_id,
                    chunk,
                    req.prefilled,
                    total_prompt_tokens=len(req.prompt),
                )
            )
            owners.append(req)
            budget -= len(chunk)
            if ahead:
                self.prefilled(req, len(chunk))
                req.launched += int(req.prefilled == len(req.prompt))
        return items, owners

    def prefilled(self, req: Request, tokens: int) -> None:
        """`tokens` more of req's prompt are in the cache (or in a launched step)."""
        req.prefilled += tokens
        if req.prefilled == len(req.prompt):
            self.prefilling.remove(req)
            self.running.append(req)

    def answer(
        self, items: list[StepItem], owners: list[Request], outcome: StepOutcome, ahead: bool
    ) -> None:
        """Take a step's results: cache ids, tokens and (steps one at a time) prompt progress."""
        for item, req, result in zip(items, owners, outcome.results, strict=True):
            if result.status == ItemStatus.DEFERRED:
                raise RuntimeError(f"{req.rid} deferred despite up-front reservation")
            req.cache_id = result.cache_id
            if item.kind == ItemKind.PREFILL_CHUNK and not ahead:
                self.prefilled(req, len(item.token_ids))
            req.generated.extend(result.token_ids)

    def finished(self) -> list[Request]:
        """Requests with every output answered, taken out (their reservations too)."""
        done = [r for r in self.running if len(r.generated) >= self.plan.engine_output]
        for req in done:
            self.running.remove(req)
            self.reserved -= self._need(req)
        return done


def make_requests(plan: Plan) -> list[Request]:
    rnd = random.Random(0)
    mean, spread = plan.engine_input
    vocab = plan.config.vocab_size
    return [
        Request(
            rid=f"r{i}",
            prompt=[rnd.randrange(vocab) for _ in range(rnd.randint(mean - spread, mean + spread))],
        )
        for i in range(plan.engine_requests)
    ]


def run_engine(
    plan: Plan, model: LlamaForCausalLM, kv_budget_bytes: int, profile: bool = True
) -> dict[str, Any]:
    """kv_budget_bytes: 0 lets the engine size its pool from measurements (CUDA)."""
    config = EngineConfig(
        model="injected",
        device=str(plan.device),
        dtype={torch.bfloat16: "bfloat16", torch.float32: "float32"}[plan.dtype],
        block_size=plan.block_size,
        kv_cache_bytes=kv_budget_bytes,
        max_batch_tokens=plan.engine_batch_tokens,
        max_batch_size=plan.engine_batch_size,
        prefix_caching=False,
        swap_space_bytes=0,
    )
    # Start-up loads by name; hand it the model we already built on the device instead.
    with mock.patch.object(startup, "load_model", return_value=(model, plan.config)):
        engine = engine_module.Engine(config)
    try:
        requests = make_requests(plan)
        report = _drive(plan, engine, requests, profile)
        report["graph_steps"] = engine.stats.graph_steps
        # The same requests again on the same engine (every cache released), launched ahead;
        # against a run one step at a time without the profiler, whose window slows a few
        # steps of the first run by far more than their share.
        again = make_requests(plan)
        graph_steps = engine.stats.graph_steps
        ahead = _drive_ahead(plan, engine, again)
        ahead_graph_steps = engine.stats.graph_steps - graph_steps
        baseline = _drive(plan, engine, make_requests(plan), False) if profile else report
        same = sum(a.generated == b.generated for a, b in zip(requests, again, strict=True))
        report["launch_ahead"] = {
            **ahead,
            "graph_steps": ahead_graph_steps,
            "baseline_output_tokens_per_s": baseline["output_tokens_per_s"],
            "speedup": ahead["output_tokens_per_s"] / baseline["output_tokens_per_s"],
            # Admission lags a step (a cache is released once its last step is finished, after
            # the next one launched), so batches differ and reduced precision may part ways.
            "identical_outputs": same / len(requests),
        }
        report["cuda_graph_batch_sizes"] = list(engine.graph_batch_sizes)
        report["memory_plan"] = {
            **engine.memory_plan.parts(),
            "kv_blocks": engine.memory_plan.num_blocks,
        }
        return report
    finally:
        engine.shutdown()


def _drive(
    plan: Plan, engine: engine_module.Engine, requests: list[Request], profile: bool = True
) -> dict[str, Any]:
    """The requests through `Batches`, one step at a time (`Engine.execute`)."""
    batches = Batches(plan, requests, engine.kv.pool.num_blocks)
    steps = prefill_tokens = decode_tokens = 0
    # Per step: (holds prefill chunks, wall seconds of execute, the engine's own timings).
    records: list[tuple[bool, float, Timings]] = []
    # A few steady-state decode steps under the profiler, from the first decode-only step at or
    # after this one (the first wave of prompts is in by then).
    profile_from = (2 if plan.device.type == "cpu" else 40) if profile else math.inf
    profiler: StepProfiler | None = None
    profiled: dict[str, Any] = {}
    started = time.perf_counter()
    while batches.busy:
        items, owners = batches.next_step(ahead=False)
        if not items:
            raise RuntimeError("continuous batching loop stalled (KV budget too small?)")
        has_prefill = any(item.kind == ItemKind.PREFILL_CHUNK for item in items)
        if not profiled and profiler is None and steps >= profile_from and not has_prefill:
            # On the engine thread: torch.profiler records the host ops of its own thread.
            profiler = engine.call_sync(StepProfiler(plan.device).start)
            profiled["batch_sizes"] = []
        step_started = time.perf_counter()
        # On the engine thread, as a server runs every step (and the thread hop with it).
        # Returns host token ids: the device is done with the step.
        outcome = engine.call_sync(engine.execute, Step(items))
        records.append((has_prefill, time.perf_counter() - step_started, outcome.timings))
        if profiler is not None:
            profiler.step()
            profiled["batch_sizes"].append(len(items))
            if profiler.steps == 5:
                profiled.update(engine.call_sync(profiler.stop))
                profiler = None
        steps += 1
        prefill, decode = _token_counts(items)
        prefill_tokens += prefill
        decode_tokens += decode
        batches.answer(items, owners, outcome, ahead=False)
        for req in batches.finished():
            engine.call_sync(engine.release, req.cache_id)
    if profiler is not None:  # the run ended inside the window
        profiled.update(engine.call_sync(profiler.stop))
    _sync(plan.device)
    elapsed = time.perf_counter() - started
    return {
        **_throughput(requests, plan.engine_output, steps, elapsed, prefill_tokens + decode_tokens),
        "execute_seconds": sum(wall for _, wall, _ in records),
        "steps_by_kind": _step_breakdown(records),
        "profile_decode_steps": profiled,
    }


def _drive_ahead(
    plan: Plan, engine: engine_module.Engine, requests: list[Request]
) -> dict[str, Any]:
    """The same requests and batching, each step launched before the previous one is
    finished (`Engine.launch`, then `Engine.finish` of the one before): on a GPU the host's
    work for one step (the engine's and this loop's) overlaps the device's for the other."""
    batches = Batches(plan, requests, engine.kv.pool.num_blocks)
    flight: deque[tuple[engine_module.LaunchedStep, list[StepItem], list[Request]]] = deque()
    steps = tokens = 0
    started = time.perf_counter()
    while batches.busy or flight:
        items, owners = batches.next_step(ahead=True)
        if items:
            launched = engine.call_sync(engine.launch, Step(items))
            for index, req in enumerate(owners):
                req.cache_id = launched.cache_id(index)  # opened at launch
                if not req.cache_id:
                    raise RuntimeError(f"{req.rid} deferred despite up-front reservation")
            flight.append((launched, items, owners))
            steps += 1
            tokens += sum(_token_counts(items))
        elif not flight:
            raise RuntimeError("continuous batching loop stalled (KV budget too small?)")
        if flight and (len(flight) > 1 or not items):
            launched, done_items, done_owners = flight.popleft()
            outcome = engine.call_sync(engine.finish, launched)
            batches.answer(done_items, done_owners, outcome, ahead=True)
            for req in batches.finished():
                engine.call_sync(engine.release, req.cache_id)
    _sync(plan.device)
    return _throughput(requests, plan.engine_output, steps, time.perf_counter() - started, tokens)


def _token_counts(items: list[StepItem]) -> tuple[int, int]:
    """(prefill tokens, decode tokens) of a step's items."""
    prefill = sum(len(i.token_ids) for i in items if i.kind == ItemKind.PREFILL_CHUNK)
    return prefill, sum(1 for i in items if i.kind == ItemKind.DECODE)


def _throughput(
    requests: list[Request], out_len: int, steps: int, elapsed: float, tokens: int
) -> dict[str, Any]:
    outputs = len(requests) * out_len
    return {
        "requests": len(requests),
        "input_tokens": sum(len(r.prompt) for r in requests),
        "output_tokens": outputs,
        "steps": steps,
        "seconds": elapsed,
        "requests_per_s": len(requests) / elapsed,
        "output_tokens_per_s": outputs / elapsed,
        "total_tokens_per_s": tokens / elapsed,
    }


def _step_breakdown(records: list[tuple[bool, float, Timings]]) -> dict[str, dict[str, float]]:
    """Steps that held prefill chunks and decode-only steps apart: how many, their wall time
    in ``execute``, and the engine's own split of it (``forward_ns`` is the launches' host
    time on CUDA; sampling waits for the device)."""
    out: dict[str, dict[str, float]] = {}
    for kind, prefill in (("with_prefill", True), ("decode_only", False)):
        rows = [(wall, t) for has_prefill, wall, t in records if has_prefill is prefill]
        if not rows:
            continue
        walls = sorted(wall for wall, _ in rows)
        n = len(rows)
        out[kind] = {
            "steps": n,
            "seconds": sum(walls),
            "p50_ms": walls[n // 2] * 1e3,
            "mean_forward_ms": sum(t.forward_ns for _, t in rows) / n / 1e6,
            "mean_sample_ms": sum(t.sample_ns for _, t in rows) / n / 1e6,
            "mean_engine_total_ms": sum(t.total_ns for _, t in rows) / n / 1e6,
        }
    return out


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def _say(*parts: object, file: Any = None) -> None:
    """Console output of the benchmark (print is reserved for scripts/ and tests/ by ruff)."""
    (file or sys.stdout).write(" ".join(str(p) for p in parts) + "\n")


def _print_table(title: str, rows: list[dict[str, Any]]) -> None:
    _say(f"\n== {title}")
    if not rows:
        return
    keys = list(dict.fromkeys(k for row in rows for k in row))
    _say(" | ".join(f"{k:>14}" for k in keys))
    for row in rows:
        cells = []
        for k in keys:
            v = row.get(k, "")
            cells.append(f"{v:>14.3f}" if isinstance(v, float) else f"{v!s:>14}")
        _say(" | ".join(cells))


def _print_profiles(profiles: dict[str, dict[str, Any]]) -> None:
    for name, prof in profiles.items():
        wall, busy = prof["wall_ms_per_step"], prof["device_busy_ms_per_step"]
        host = prof["host_op_ms_per_step"]
        _say(f"\n== profile {name}: {wall:.3f} ms a step, device busy {busy:.3f}, host {host:.3f}")
        for side in ("top_device", "top_host"):
            for row in prof[side][:6]:
                us, calls = row["us_per_step"], row["calls_per_step"]
                _say(f"  {side[4:]:>6} {us:9.1f} us  x{calls:<6.1f} {row['op']}")


def _attempt(
    report: dict[str, Any],
    name: str,
    fn: Callable[[], Any],
    save: Callable[[], None],
    keep: bool = True,
) -> Any | None:
    """Run one section and, with ``keep``, store its value under ``name``. A failure is recorded
    under ``errors`` (with its traceback) and the later sections still run; the report is written
    after every section, so a run that a device lease cuts short keeps what it measured. Returns
    the section's value, None if it failed."""
    started = time.perf_counter()
    try:
        value = fn()
        if keep:
            report[name] = value
    except Exception as exc:
        report.setdefault("errors", {})[name] = traceback.format_exc()
        _say(f"\n!! section {name} failed: {exc!r}", file=sys.stderr)
        value = None
        if torch.cuda.is_available():
            # After a device fault (an illegal address) this raises too, as it did on the first
            # H200 run from inside this handler, which lost the report; the later sections then
            # fail fast and are recorded.
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()
    report.setdefault("section_seconds", {})[name] = time.perf_counter() - started
    save()
    return value


def run(
    plan: Plan,
    *,
    skip_engine: bool = False,
    profile: bool = True,
    tp_args: argparse.Namespace | None = None,
    save: Callable[[dict[str, Any]], None] = lambda report: None,
) -> dict[str, Any]:
    """tp_args: the parsed flags of a ``--tensor-parallel-size N`` run (N > 1), else None.
    save: called with the report after every section (see ``_attempt``)."""
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(plan.device) if plan.device.type == "cuda" else "cpu",
        "backend": select_backend(plan.device).name,
        "torch": torch.__version__,
        "tensor_parallel_size": tp_args.tensor_parallel_size if tp_args else 1,
    }

    def attempt(name: str, fn: Callable[[], Any], keep: bool = True) -> Any | None:
        return _attempt(report, name, fn, lambda: save(report), keep)

    rates = attempt("rates", lambda: measure_rates(plan))
    if rates is None:
        return report  # every later section is judged against these rates
    _print_table("rates", [rates])
    if tp_args is not None:
        world = tp_args.tensor_parallel_size
        attempt("tensor_parallel", lambda: run_tensor_parallel(plan, world, tp_args))
        _say(
            f"\n(TP={world}: kernels, CUDA graphs and the engine section are single-device "
            "and skipped; run without --tensor-parallel-size for them)"
        )
        return report

    kernels = attempt("kernels", lambda: bench_kernels(plan))
    if kernels is not None:
        _print_table("kernels (torch vs triton)", kernels)
    sweep = attempt("split_sweep", lambda: bench_split_sweep(plan))
    if sweep:
        _print_table("decode attention by KV split count (us; Triton)", sweep)

    model = attempt("model", lambda: build_model(plan), keep=False)
    if model is None:
        return report
    # The kernels the server would wire in (Triton on CUDA), for eager and graph steps alike.
    model.bind_backend(select_backend(plan.device))
    report["weight_bytes"] = weight_bytes(model)
    decode_items = [(plan.decode_context, 1)] * max(plan.decode_batches)
    prefill_items = [(0, n) for n in plan.prefill_items]
    num_blocks = max(blocks_for(plan, decode_items), blocks_for(plan, prefill_items))
    kv = make_kv_cache(plan, num_blocks + 1)  # + the graphs' scratch block
    # partial, not lambda: the sections must not hold kv and graphs past their ``del``.
    graphs = attempt(
        "cuda_graphs",
        partial(build_decode_graphs, plan, model, kv, scratch_block=num_blocks),
        keep=False,
    )
    decode = attempt("decode", partial(bench_decode, plan, model, kv, rates, graphs))
    if decode is not None:
        _print_table("decode step (context ~512; eager and CUDA graph)", decode)
    prefill = attempt("prefill", partial(bench_prefill, plan, model, kv, rates))
    if prefill is not None:
        _print_table("prefill", [prefill])
    if profile:  # after the plain timings: a profiler that crashes the process costs only itself
        profiled = attempt("profile", partial(bench_profile, plan, model, kv, graphs))
        if profiled is not None:
            _print_profiles(profiled)
    del graphs, kv
    if plan.device.type == "cuda":
        torch.cuda.empty_cache()

    if not skip_engine:
        # CUDA: the engine measures and plans its own pool; CPU: a small fixed one.
        budget = 0 if plan.device.type == "cuda" else 4 * 1024**2
        engine = attempt("engine", lambda: run_engine(plan, model, budget, profile))
        if engine is not None:
            report["memory_plan"] = engine.pop("memory_plan")
            save(report)
            _print_table("offline throughput (engine, greedy)", [engine])
            gib = {k: v / GIB if k != "kv_blocks" else v for k, v in report["memory_plan"].items()}
            _print_table("engine memory plan (GiB)", [gib])
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON report")
    parser.add_argument("--dry-run", action="store_true", help="tiny CPU run of every code path")
    parser.add_argument("--requests", type=int, default=1000, help="offline workload size")
    parser.add_argument("--skip-engine", action="store_true", help="skip the offline section")
    parser.add_argument(
        "--no-profile", action="store_true", help="skip the torch.profiler summaries"
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="also time the model split over N GPUs (cuda:0..N-1; N gloo CPU ranks with "
        "--dry-run) against TP=1; needs N visible GPUs",
    )
    # Internal: how this script starts itself as one rank of a --tensor-parallel-size run.
    parser.add_argument("--split-rank", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--split-init", default="", help=argparse.SUPPRESS)
    parser.add_argument("--split-result", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    world = args.tensor_parallel_size
    if world < 1:
        _say(f"--tensor-parallel-size must be >= 1, got {world}", file=sys.stderr)
        return 2
    if args.split_rank >= 0:
        return split_rank_main(args)
    if args.dry_run:
        plan = dry_plan(args)
    else:
        if not torch.cuda.is_available():
            _say("no CUDA device: use --dry-run for the CPU smoke run", file=sys.stderr)
            return 2
        visible = torch.cuda.device_count()
        if visible < world:
            shown = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
            _say(
                f"--tensor-parallel-size {world} needs {world} GPUs, but torch sees {visible} "
                f"(CUDA_VISIBLE_DEVICES={shown}); nothing was run",
                file=sys.stderr,
            )
            return 2
        plan = real_plan(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(report: dict[str, Any]) -> None:
        report["dry_run"] = bool(args.dry_run)
        args.out.write_text(json.dumps(report, indent=2, default=str))

    report = run(
        plan,
        skip_engine=args.skip_engine,
        profile=not args.no_profile,
        tp_args=args if world > 1 else None,
        save=save,
    )
    save(report)
    _say(f"\nwrote {args.out}")
    failed = sorted(report.get("errors", {}))
    if failed:
        _say(
            f"sections that failed (tracebacks under 'errors'): {', '.join(failed)}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    import logging

    import structlog

    # The engine logs every cache open/release at debug level: thousands of lines per run.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    sys.exit(main())
