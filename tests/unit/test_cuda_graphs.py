"""Decode graphs on CPU: buckets, padding, static buffers and the runner/engine wiring.

`EagerCapturer` stands in for CUDA graphs: a "replay" runs the captured function again over the
same static buffers, so everything but the graph itself (launch capture) is exercised here. The
graph-safe attention is the torch reference over the whole table width.
"""

from __future__ import annotations

import gc
import itertools
import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from ferrum_kernels.attention import reference_decode_attention
from ferrum_kernels.backend import KernelBackend, torch_backend
from ferrum_server import engine as engine_module
from ferrum_server import startup
from ferrum_server.config import EngineConfig
from ferrum_server.cuda_graphs import (
    DecodeGraphLayout,
    DecodeGraphs,
    EagerCapturer,
    bucket_for,
    graph_batch_sizes,
    graph_capturer_for,
)
from ferrum_server.domain import ItemKind, OutputPolicy, Sampling, StepItem
from ferrum_server.kv.manager import Cache
from ferrum_server.models import CausalLM, ModelConfig, load_model, tiny_config
from ferrum_server.models.tiny import build_tiny
from ferrum_server.runner import ModelRunner
from helpers_engine import greedy_decode
from helpers_models import save_gemma

BLOCK = 4
MAX_SEQ = 48  # -> static block tables of 12 columns
LOGITS = Sampling(policy=OutputPolicy.LOGITS)
_CPU_FLOAT32 = {"dtype": torch.float32, "device": torch.device("cpu")}


def _graph_backend() -> KernelBackend:
    return replace(torch_backend(), decode_attention=reference_decode_attention)


# -- buckets --------------------------------------------------------------------------------


def test_bucket_sizes() -> None:
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(5) == (1, 2, 4, 5)
    assert graph_batch_sizes(16) == (1, 2, 4, 8, 16)
    assert graph_batch_sizes(40) == (1, 2, 4, 8, 16, 32, 40)
    sizes = graph_batch_sizes(256)
    assert sizes[:6] == (1, 2, 4, 8, 16, 32) and sizes[-1] == 256 and len(sizes) == 20
    assert all(b - a == 16 for a, b in itertools.pairwise(sizes[4:]))
    assert graph_batch_sizes(320)[-3:] == (256, 288, 320)
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_bucket_selection() -> None:
    sizes = graph_batch_sizes(48)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16, 17, 47, 48)] == [
        1,
        2,
        4,
        8,
        8,
        16,
        16,
        32,
        48,
        48,
    ]
    assert bucket_for(49, sizes) is None


def test_no_real_graphs_off_cuda() -> None:
    assert graph_capturer_for(torch.device("cpu")) is None


# -- static buffers and padding over the tiny model -----------------------------------------


class _Pool:
    """The tiny model, a KV pool whose last block is the scratch block, and live sequences."""

    def __init__(
        self,
        num_blocks: int = 320,
        max_batch: int = 8,
        windows: tuple[int, ...] = (),
        model: tuple[CausalLM, ModelConfig] | None = None,  # default: the tiny model
    ) -> None:
        if model is None:
            self.config = replace(tiny_config(), sliding_windows=windows)
            self.model = build_tiny(torch.float32, "cpu")
            for layer, window in zip(self.model.layers, windows, strict=False):
                layer.window = window
        else:
            self.model, self.config = model
        c = self.config
        self.num_blocks = num_blocks
        self.kv = torch.zeros(
            (c.num_layers, 2, num_blocks + 1, BLOCK, c.num_kv_heads, c.head_dim)
        )  # [L, 2, NB + scratch, BS, Hkv, D]
        self.runner = ModelRunner(self.model, self.kv, BLOCK, c.vocab_size, torch.device("cpu"))
        layout = DecodeGraphLayout(
            block_size=BLOCK,
            max_blocks_per_sequence=MAX_SEQ // BLOCK,
            scratch_block=num_blocks,
            batch_sizes=graph_batch_sizes(max_batch),
        )
        self.graphs = DecodeGraphs(self.model, self.kv, layout, _graph_backend(), EagerCapturer())
        # Shuffled block ids so tables are not contiguous.
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        self.seqs: list[Cache] = []

    def open(self, prompt_len: int, seed: int) -> Cache:
        """A sequence with a prefilled prompt of prompt_len tokens."""
        gen = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, self.config.vocab_size, (prompt_len,), generator=gen).tolist()
        seq = Cache(f"c{seed}", f"r{seed}", MAX_SEQ)
        self._grow(seq, prompt_len)
        item = StepItem(ItemKind.PREFILL_CHUNK, seq.request_id, "", prompt, 0, prompt_len)
        self.runner.run([item], [seq])
        seq.token_ids.extend(prompt)
        self.seqs.append(seq)
        return seq

    def _grow(self, seq: Cache, length: int) -> None:
        while len(seq.block_ids) * BLOCK < length:
            seq.block_ids.append(self.free.pop())

    def decode_items(self, seqs: list[Cache], step: int) -> list[StepItem]:
        items = []
        for seq in seqs:
            self._grow(seq, seq.num_tokens + 1)
            token = (7 * seq.num_tokens + step) % self.config.vocab_size
            items.append(
                StepItem(
                    ItemKind.DECODE,
                    seq.request_id,
                    seq.cache_id,
                    [token],
                    seq.num_tokens,
                    0,
                    0,
                    LOGITS,
                )
            )
        return items

    def commit(self, seqs: list[Cache], items: list[StepItem]) -> None:
        for seq, item in zip(seqs, items, strict=True):
            seq.token_ids.extend(item.token_ids)


@pytest.fixture(scope="module")
def pool() -> Iterator[_Pool]:
    p = _Pool()
    p.graphs.capture()
    yield p


def _logits(output: object) -> torch.Tensor:
    rows = output.logits_rows  # type: ignore[attr-defined]
    return torch.stack(
        [torch.frombuffer(bytearray(rows[r]), dtype=torch.float32) for r in sorted(rows)]
    )


def test_capture_covers_every_bucket(pool: _Pool) -> None:
    assert pool.graphs.batch_sizes == (1, 2, 4, 8)
    assert pool.graphs.accepts(8, MAX_SEQ // BLOCK)
    assert not pool.graphs.accepts(9, 1)
    assert not pool.graphs.accepts(1, MAX_SEQ // BLOCK + 1)


@pytest.mark.parametrize("batch", [1, 3, 5, 8])
def test_padded_replay_matches_the_eager_forward(pool: _Pool, batch: int) -> None:
    """B real rows padded to the bucket give the unpadded eager forward's logits, write K/V only
    to the real rows' slots and the scratch block, and leave every other block untouched."""
    seqs = [pool.open(prompt_len=3 + 5 * i, seed=100 * batch + i) for i in range(batch)]
    for step in range(2):
        items = pool.decode_items(seqs, step)
        # A marker in the scratch block shows whether padding rows wrote there (they always
        # write the same K/V, so without it a second write would look like none).
        pool.kv[:, :, pool.num_blocks] = 7.0
        before = pool.kv.clone()
        pool.runner.graphs = pool.graphs
        graphed = pool.runner.run(items, seqs)
        after_graph = pool.kv.clone()
        pool.runner.graphs = None
        eager = pool.runner.run(items, seqs)
        assert graphed.graphed and not eager.graphed
        torch.testing.assert_close(_logits(graphed), _logits(eager), atol=1e-5, rtol=1e-5)

        # Which slots may the graph step have written? The real rows' new positions, and (when
        # the batch was padded) the scratch block.
        written = torch.zeros(pool.num_blocks + 1, BLOCK, dtype=torch.bool)
        for seq, item in zip(seqs, items, strict=True):
            written[seq.block_ids[item.position // BLOCK], item.position % BLOCK] = True
        written[pool.num_blocks] = True
        changed = (after_graph != before).flatten(4).any(-1).any(0).any(0)  # [NB + 1, BS]
        assert not (changed & ~written).any(), "a padding row touched a live KV block"
        # The graph's K/V equal the eager step's (which rewrote the same slots).
        torch.testing.assert_close(after_graph, pool.kv, atol=1e-6, rtol=1e-6)
        # Padding rows write position 0 of the scratch block, and only when there are any.
        padded = bucket_for(batch, pool.graphs.batch_sizes) != batch
        assert changed[pool.num_blocks].tolist() == [padded, False, False, False]
        pool.commit(seqs, items)


def test_mixed_and_oversized_steps_run_eagerly(pool: _Pool) -> None:
    pool.runner.graphs = pool.graphs
    try:
        seqs = [pool.open(prompt_len=2, seed=900 + i) for i in range(9)]
        items = pool.decode_items(seqs, 0)
        assert not pool.runner.run(items, seqs).graphed  # 9 > the largest bucket
        pool.commit(seqs, items)
        fresh = Cache("cnew", "rnew", MAX_SEQ, block_ids=[pool.free.pop()])
        prefill = StepItem(ItemKind.PREFILL_CHUNK, "rnew", "", [5, 6], 0, 2)
        decode = pool.decode_items(seqs[:1], 1)
        assert not pool.runner.run([prefill, *decode], [fresh, seqs[0]]).graphed
    finally:
        pool.runner.graphs = None


def test_replay_result_is_independent_of_stale_buffer_contents(pool: _Pool) -> None:
    """A narrow step after a wide one: stale table columns and rows must not leak in."""
    long_seqs = [pool.open(prompt_len=40, seed=1200 + i) for i in range(4)]
    short = [pool.open(prompt_len=1, seed=1300)]
    pool.runner.graphs = pool.graphs
    try:
        wide_items = pool.decode_items(long_seqs, 0)
        pool.runner.run(wide_items, long_seqs)
        pool.commit(long_seqs, wide_items)
        items = pool.decode_items(short, 0)
        graphed = pool.runner.run(items, short)
        pool.runner.graphs = None
        eager = pool.runner.run(items, short)
    finally:
        pool.runner.graphs = None
    torch.testing.assert_close(_logits(graphed), _logits(eager), atol=1e-5, rtol=1e-5)


def test_sliding_window_layers_replay_like_the_eager_forward() -> None:
    """A model with a windowed layer (window 5) beside a global one: the captured decode passes
    each layer's window to the graph-safe attention, with contexts well past the window."""
    p = _Pool(num_blocks=64, max_batch=4, windows=(5, 0))
    p.graphs.capture()
    seqs = [p.open(prompt_len=n, seed=1400 + n) for n in (3, 17, 30)]
    for step in range(2):
        items = p.decode_items(seqs, step)
        p.runner.graphs = p.graphs
        graphed = p.runner.run(items, seqs)
        p.runner.graphs = None
        eager = p.runner.run(items, seqs)
        assert graphed.graphed
        torch.testing.assert_close(_logits(graphed), _logits(eager), atol=1e-5, rtol=1e-5)
        p.commit(seqs, items)


def test_gemma_soft_capped_layers_replay_like_the_eager_forward(tmp_path: Path) -> None:
    """Gemma 2 (attention soft-cap, windowed and global layers): the captured decode passes
    each layer's soft-cap to the graph-safe attention."""
    save_gemma(tmp_path, "gemma2")
    p = _Pool(num_blocks=64, max_batch=4, model=load_model(str(tmp_path), **_CPU_FLOAT32))
    p.graphs.capture()
    seqs = [p.open(prompt_len=n, seed=1500 + n) for n in (3, 17)]
    for step in range(2):
        items = p.decode_items(seqs, step)
        p.runner.graphs = p.graphs
        graphed = p.runner.run(items, seqs)
        p.runner.graphs = None
        eager = p.runner.run(items, seqs)
        assert graphed.graphed
        torch.testing.assert_close(_logits(graphed), _logits(eager), atol=1e-5, rtol=1e-5)
        p.commit(seqs, items)


def test_graphs_need_graph_safe_attention_and_a_scratch_block() -> None:
    p = _Pool(num_blocks=4, max_batch=2)
    layout = p.graphs.layout
    with pytest.raises(ValueError, match="graph-safe"):
        DecodeGraphs(p.model, p.kv, layout, torch_backend(), EagerCapturer())
    with pytest.raises(ValueError, match="scratch block"):
        DecodeGraphs(
            p.model,
            p.kv,
            replace(layout, scratch_block=99),
            _graph_backend(),
            EagerCapturer(),
        )


class _AddressOnlyGraph:
    """Like a CUDA graph: it replays what was captured but holds no reference to it (a real
    graph keeps raw device addresses, so whatever the captured function closed over must be
    kept alive by its owner, or the replay reads freed memory)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = weakref.ref(fn)

    def replay(self) -> None:
        fn = self._fn()
        if fn is None:
            raise AssertionError("the captured function (and the tensors it holds) was freed")
        fn()


class _AddressOnlyCapturer:
    def capture(self, fn: Callable[[], None]) -> _AddressOnlyGraph:
        fn()
        return _AddressOnlyGraph(fn)


def test_graphs_keep_what_their_captured_forward_holds_alive() -> None:
    """The decode attention's index tensors and the metadata are built outside capture; the
    first GPU run found them freed after capture (garbage logits, then illegal accesses)."""
    p = _Pool(num_blocks=64, max_batch=4)
    p.graphs = DecodeGraphs(
        p.model, p.kv, p.graphs.layout, _graph_backend(), _AddressOnlyCapturer()
    )
    p.graphs.capture()
    gc.collect()
    seqs = [p.open(5 + 3 * i, seed=i) for i in range(3)]
    items = p.decode_items(seqs, 0)
    p.runner.graphs = p.graphs
    graphed = p.runner.run(items, seqs)
    p.runner.graphs = None
    eager = p.runner.run(items, seqs)
    assert graphed.graphed and not eager.graphed
    torch.testing.assert_close(_logits(graphed), _logits(eager), atol=1e-5, rtol=1e-5)


# -- the engine wiring ----------------------------------------------------------------------


@pytest.fixture
def eager_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the engine 'capture' eager stand-ins on CPU, with the reference decode attention."""
    monkeypatch.setattr(startup, "graph_capturer_for", lambda device: EagerCapturer())
    monkeypatch.setattr(startup, "select_backend", lambda device, prefer="auto": _graph_backend())


def _generate(engine: engine_module.Engine, num_requests: int, steps: int) -> list[list[int]]:
    """Greedy tokens of num_requests prompts decoded together for `steps` steps."""
    prompts = [[(11 * r + 3 * i) % 512 for i in range(5 + 3 * r)] for r in range(num_requests)]
    return greedy_decode(engine, prompts, steps)


@pytest.mark.usefixtures("eager_graphs")
def test_engine_plans_a_scratch_block_and_replays_decode_steps() -> None:
    config = EngineConfig(
        block_size=BLOCK,
        kv_cache_bytes=64 * tiny_config().kv_bytes_per_token(torch.float32) * BLOCK,
        max_sequence_length=MAX_SEQ,
        max_batch_size=8,
        cuda_graph_max_batch=4,
    )
    graphed = engine_module.Engine(config)
    try:
        plan = graphed.memory_plan
        assert graphed.graph_batch_sizes == (1, 2, 4)
        assert plan.reserved_blocks == 1 and plan.num_blocks == 63
        assert graphed.kv.pool.num_blocks == 63 and graphed.kv_cache.shape[2] == 64
        assert plan.cuda_graph_bytes == 0  # nothing measurable off CUDA
        tokens = {n: _generate(graphed, n, steps=4) for n in (1, 3, 6)}
        # 1 and 3 items replay (buckets 1 and 4); 6 is above the largest bucket: eager.
        assert graphed.stats.graph_steps == 8
    finally:
        graphed.shutdown()
    eager = engine_module.Engine(replace(config, cuda_graphs=False))
    try:
        assert eager.graph_batch_sizes == () and eager.memory_plan.reserved_blocks == 0
        assert eager.kv.pool.num_blocks == 64
        for n, want in tokens.items():
            assert _generate(eager, n, steps=4) == want
        assert eager.stats.graph_steps == 0
    finally:
        eager.shutdown()


def test_engine_without_graph_safe_kernels_runs_eagerly() -> None:
    # The CPU default: no capturer at all; and the torch kernels have no graph-safe decode.
    engine = engine_module.Engine(EngineConfig(block_size=BLOCK, kv_cache_bytes=1 << 20))
    try:
        assert engine.graph_batch_sizes == ()
        assert engine.memory_plan.reserved_blocks == 0
        assert engine.memory_plan.num_blocks == engine.kv.pool.num_blocks
        assert engine.memory_plan.kv_cache_bytes == 1 << 20
        assert torch_backend().decode_attention is None
    finally:
        engine.shutdown()


def test_engine_config_validates_graph_batch() -> None:
    with pytest.raises(ValueError, match="CUDA graph batch"):
        EngineConfig(cuda_graph_max_batch=0)
    assert EngineConfig(max_batch_size=32).graph_max_batch == 32
    assert EngineConfig(cuda_graph_max_batch=8).graph_max_batch == 8
    assert math.isclose(EngineConfig().gpu_memory_utilization, 0.9)


def test_startup_profile_runs_its_steps_on_cpu() -> None:
    """The CUDA start-up profile's code path (largest prefill, full decode batch with the
    costliest sampling, trial graph capture) runs on CPU; only the measurements are CUDA's."""
    from ferrum_server.profiling import ProfileShape, model_bytes, profile_startup

    config = tiny_config()
    model = build_tiny(torch.float32, "cpu")
    built: list[DecodeGraphs] = []

    def build(pool: torch.Tensor, scratch: int, sizes: tuple[int, ...]) -> DecodeGraphs:
        layout = DecodeGraphLayout(BLOCK, MAX_SEQ // BLOCK, scratch, sizes)
        graphs = DecodeGraphs(model, pool, layout, _graph_backend(), EagerCapturer())
        built.append(graphs)
        return graphs

    shape = ProfileShape(
        block_size=BLOCK,
        max_batch_tokens=40,
        max_batch_size=6,
        max_sequence_length=MAX_SEQ,
        max_num_logprobs=5,
    )
    sizes = graph_batch_sizes(4)
    profile = profile_startup(
        model,
        config,
        torch_backend(),
        dtype=torch.float32,
        device=torch.device("cpu"),
        shape=shape,
        graphs=(build, sizes),
    )
    assert profile.activation_peak_bytes == 0
    # Nothing is measurable off CUDA, so only the per-graph floor and the margin remain.
    assert profile.cuda_graph_bytes == (len(sizes) - 1) * 2 * 1024**2 + 64 * 1024**2
    assert built[0].batch_sizes == (2, 4)  # the trial captures the two largest buckets
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model_bytes(model) > weights  # the RoPE tables count too
