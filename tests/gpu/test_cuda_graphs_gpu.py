"""Real CUDA graphs and the measured memory plan on a CUDA device.

Run with ``pytest tests/gpu -m gpu`` in its own process (see test_gpu_kernels.py for why).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from helpers_gpu import require_cuda_and_triton

pytestmark = pytest.mark.gpu

require_cuda_and_triton()

from ferrum_kernels.backend import select_backend  # noqa: E402
from ferrum_server.config import EngineConfig  # noqa: E402
from ferrum_server.cuda_graphs import (  # noqa: E402
    CudaGraphCapturer,
    DecodeGraphLayout,
    DecodeGraphs,
    bucket_for,
    graph_batch_sizes,
)
from ferrum_server.domain import ItemKind, OutputPolicy, Sampling, StepItem  # noqa: E402
from ferrum_server.engine import Engine  # noqa: E402
from ferrum_server.kv.manager import Cache  # noqa: E402
from ferrum_server.models import tiny_config  # noqa: E402
from ferrum_server.models.tiny import build_tiny  # noqa: E402
from ferrum_server.runner import ModelRunner  # noqa: E402
from helpers_engine import greedy_decode  # noqa: E402

DEV = torch.device("cuda")
BLOCK = 16
MAX_SEQ = 1024
LOGITS = Sampling(policy=OutputPolicy.LOGITS)


def _free_cuda() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def setup(request: pytest.FixtureRequest) -> Iterator[tuple[ModelRunner, DecodeGraphs, int]]:
    dtype: torch.dtype = request.param
    config = tiny_config()
    model = build_tiny(dtype, DEV)
    num_blocks = 2048
    kv = torch.zeros(
        (config.num_layers, 2, num_blocks + 1, BLOCK, config.num_kv_heads, config.head_dim),
        dtype=dtype,
        device=DEV,
    )
    backend = select_backend(DEV, "triton")
    runner = ModelRunner(model, kv, BLOCK, config.vocab_size, DEV, backend)
    layout = DecodeGraphLayout(BLOCK, MAX_SEQ // BLOCK, num_blocks, graph_batch_sizes(64))
    graphs = DecodeGraphs(model, kv, layout, backend, CudaGraphCapturer(DEV))
    graphs.capture()
    yield runner, graphs, num_blocks
    del runner, graphs, kv, model
    _free_cuda()


def _logits(output: object) -> torch.Tensor:
    rows = output.logits_rows  # type: ignore[attr-defined]
    return torch.stack(
        [torch.frombuffer(bytearray(rows[r]), dtype=torch.float32) for r in sorted(rows)]
    )


@pytest.mark.parametrize("batch", [1, 3, 8, 13, 64])
def test_graph_replay_equals_eager(
    setup: tuple[ModelRunner, DecodeGraphs, int], batch: int
) -> None:
    runner, graphs, num_blocks = setup
    assert all(isinstance(g, torch.cuda.CUDAGraph) for g in graphs.graphs.values())
    vocab = tiny_config().vocab_size
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(batch)).tolist()
    seqs: list[Cache] = []
    for i in range(batch):
        length = 1 + (97 * i) % 700  # contexts from 1 to ~700, several block boundaries
        blocks = [perm.pop() for _ in range((length + BLOCK) // BLOCK + 1)]
        seq = Cache(f"c{i}", f"r{i}", MAX_SEQ, block_ids=blocks)
        prompt = [(13 * i + 7 * j) % vocab for j in range(length)]
        runner.run([StepItem(ItemKind.PREFILL_CHUNK, f"r{i}", "", prompt, 0, length)], [seq])
        seq.token_ids.extend(prompt)
        seqs.append(seq)
    kv = runner.kv_cache
    for step in range(3):
        items = [
            StepItem(
                ItemKind.DECODE,
                s.request_id,
                s.cache_id,
                [(5 * step + i) % vocab],
                s.num_tokens,
                sampling=LOGITS,
            )
            for i, s in enumerate(seqs)
        ]
        kv[:, :, num_blocks] = 3.0  # marker: shows whether padding rows wrote the scratch block
        before = kv.clone()
        runner.graphs = graphs
        graphed = runner.run(items, seqs)
        torch.cuda.synchronize()
        after = kv.clone()
        runner.graphs = None
        eager = runner.run(items, seqs)
        assert graphed.graphed and not eager.graphed
        # The graph's split count is fixed for the longest context, so its float sums run in
        # a different order than the eager launch's: equal to rounding, not bit for bit.
        tol = 1e-4 if runner.kv_cache.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(_logits(graphed), _logits(eager), atol=tol, rtol=tol)
        changed = (after != before).flatten(4).any(-1).any(0).any(0)  # [NB + 1, BS]
        allowed = torch.zeros_like(changed)
        for seq, item in zip(seqs, items, strict=True):
            allowed[seq.block_ids[item.position // BLOCK], item.position % BLOCK] = True
        allowed[num_blocks, 0] = True
        assert not (changed & ~allowed).any(), "the graph step wrote outside its slots"
        padded = bucket_for(batch, graphs.batch_sizes) != batch
        assert bool(changed[num_blocks, 0]) == padded
        for seq, item in zip(seqs, items, strict=True):
            seq.token_ids.extend(item.token_ids)


def _engine(**overrides: object) -> Engine:
    config = EngineConfig(
        device="cuda",
        # float32: the token comparison with the eager engine must not hinge on bf16 rounding
        # (graph steps pad the LM-head GEMM and fix the attention split count).
        dtype="float32",
        block_size=BLOCK,
        gpu_memory_utilization=0.2,  # keeps the pool (and its zero-fill) modest
        max_batch_tokens=2048,
        max_batch_size=64,
        max_sequence_length=MAX_SEQ,
        cuda_graph_max_batch=32,
    )
    return Engine(replace(config, **overrides))  # type: ignore[arg-type]


def _generate(engine: Engine, num_requests: int, steps: int) -> list[list[int]]:
    """Greedy tokens of num_requests prompts decoded together for `steps` steps."""
    lengths = [8 + (5 * r) % 24 for r in range(num_requests)]
    prompts = [[(11 * r + 3 * i) % 512 for i in range(n)] for r, n in enumerate(lengths)]
    return greedy_decode(engine, prompts, steps)


def test_engine_memory_plan_is_consistent_and_graphs_decode() -> None:
    engine = _engine()
    try:
        plan = engine.memory_plan
        total = torch.cuda.get_device_properties(DEV).total_memory
        assert plan.total_bytes == total
        assert plan.activation_peak_bytes > 0
        assert plan.cuda_graph_reserved_bytes > 0 and plan.cuda_graph_bytes > 0
        assert plan.graphs_within_reservation, plan
        assert (
            plan.weights_bytes
            + plan.activation_peak_bytes
            + plan.cuda_graph_bytes
            + plan.kv_cache_bytes
            <= total * plan.utilization
        ), plan
        assert plan.planned_bytes <= plan.budget_bytes
        # Nothing but whole-block rounding is left on the table.
        assert plan.budget_bytes - plan.planned_bytes < plan.block_bytes
        pool_bytes = engine.kv_cache.numel() * engine.kv_cache.element_size()
        assert pool_bytes == plan.kv_cache_bytes
        assert engine.kv.pool.num_blocks == plan.num_blocks == engine.kv_cache.shape[2] - 1
        assert engine.graph_batch_sizes == graph_batch_sizes(32)
        graphed = {n: _generate(engine, n, steps=5) for n in (1, 7, 40)}
        assert engine.stats.graph_steps == 10  # 1 and 7 replay; 40 > 32 runs eagerly
    finally:
        engine.shutdown()
        del engine
        _free_cuda()
    eager = _engine(cuda_graphs=False)
    try:
        assert eager.graph_batch_sizes == () and eager.memory_plan.cuda_graph_bytes == 0
        for n, want in graphed.items():
            assert _generate(eager, n, steps=5) == want
    finally:
        eager.shutdown()
        del eager
        _free_cuda()


def test_explicit_kv_size_that_does_not_fit_fails_in_one_line() -> None:
    total = torch.cuda.get_device_properties(DEV).total_memory
    with pytest.raises(ValueError, match="--kv-cache-bytes") as info:
        _engine(kv_cache_bytes=total)
    assert "\n" not in str(info.value)
    _free_cuda()
