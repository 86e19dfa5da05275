"""An LM head's greedy choice folded by its GEMM (``packed_gemm_greedy``, the AVX-512 GEMM's
kGreedy store): the same tokens and log-probs, bit for bit, as sampling the logits the head
writes otherwise; the backend's ``greedy_logits``; and the runner taking it for steps whose
every output row is a plain argmax, and only for those."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from ferrum_kernels import native
from ferrum_kernels.backend import cpu_backend, torch_backend
from ferrum_kernels.cpu_linear import PackedWeight, greedy_linear, prepack_linears
from ferrum_kernels.layers import TiedLinear
from ferrum_kernels.sampling import SamplingTensors, sample
from ferrum_server.config import EngineConfig
from ferrum_server.domain import (
    GREEDY,
    OutputPolicy,
    Sampling,
)
from ferrum_server.engine import Engine
from ferrum_server.models.llama import LlamaForCausalLM
from helpers_engine import decode_with
from helpers_models import save_gemma
from helpers_native import needs_avx512_float32_gemm
from torch import nn

_module = native.load()
_AMX = _module is not None and bool(_module.amx_available())


@contextmanager
def _tiles(amx: bool) -> Iterator[None]:
    """The bfloat16 GEMM on AMX tiles (amx) or on its register tiles, for the block."""
    assert _module is not None
    before = _module.set_amx(amx)
    try:
        yield
    finally:
        _module.set_amx(before)


def _logits(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    """What the head writes for sampling: float32 logits (bfloat16 ones widened)."""
    assert _module is not None
    if x.dtype == torch.bfloat16:
        out: torch.Tensor = _module.packed_gemm_widened(x, packed, bias, n)
        return out
    out = _module.packed_gemm(x, packed, bias, n)
    return out


def _sampled(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = sample(logits, SamplingTensors.greedy(logits.shape[0], "cpu"))
    return out.token_ids, out.logprobs


def _cases() -> list[tuple[torch.dtype, bool]]:
    cases = [(torch.float32, False), (torch.bfloat16, False)]
    return cases + ([(torch.bfloat16, True)] if _AMX else [])


@pytest.mark.parametrize(("dtype", "amx"), _cases())
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 32000, 128),  # a decode row over a vocabulary: 32 fold segments
        (7, 1000, 64),  # one segment, a last panel of 8 columns
        (33, 4099, 96),  # a 32-row block and a row past it; a last panel of 3 columns
        (64, 2049, 32),  # a decode step's rows; a segment of one column at the end
        (3, 17, 32),  # the second half of the only panel holds one column
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
@torch.no_grad()
def test_the_folded_choice_is_the_sampled_one_bit_for_bit(
    dtype: torch.dtype, amx: bool, m: int, n: int, k: int, threads: int
) -> None:
    """Tokens and log-probs as ``sample`` gives them from the written logits, exactly, with and
    without a bias, on one thread or two (the threads split the fold segments)."""
    if dtype == torch.float32 and (_module is None or not _module.gemm_isa()[1]):
        pytest.skip("native AVX-512 float32 GEMM not built")
    if dtype == torch.bfloat16 and (_module is None or not _module.gemm_bf16_available()):
        pytest.skip("native bfloat16 GEMM not built")
    assert _module is not None
    gen = torch.Generator().manual_seed(m * 7 + n)
    w = (torch.randn(n, k, generator=gen) * 0.3).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    packed = _module.pack_gemm_weight(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with _tiles(amx):
            for bias in (None, torch.randn(n, generator=gen).to(dtype)):
                ids, logprobs, finite = _module.packed_gemm_greedy(x, packed, bias, n)
                want_ids, want_logprobs = _sampled(_logits(x, packed, bias, n))
                assert bool(finite.all())
                assert torch.equal(ids, want_ids)
                assert torch.equal(logprobs, want_logprobs)
                exact = torch.log_softmax(_logits(x, packed, bias, n).double(), dim=-1)
                assert torch.allclose(
                    logprobs.double(), exact.gather(1, ids[:, None])[:, 0], atol=1e-5
                )
    finally:
        torch.set_num_threads(before)


@needs_avx512_float32_gemm
@torch.no_grad()
def test_ties_go_to_the_first_column_across_chunks_segments_and_threads() -> None:
    """Equal largest logits (duplicated weight rows) pick the lowest column, as argmax does:
    within a 16-lane half, across a panel's halves, across panels, and across fold segments
    and the threads that fold them."""
    assert _module is not None
    gen = torch.Generator().manual_seed(3)
    n, k = 5000, 64
    w = torch.randn(n, k, generator=gen) * 0.1
    x = torch.zeros(6, k)
    for row, columns in enumerate(
        [(3, 9), (14, 20), (31, 40), (700, 1500), (1023, 1024), (2100, 4999)]
    ):
        x[row, row] = 5.0  # row r's largest logit, 25, in exactly its two columns
        for column in columns:
            w[column] = 0.0
            w[column, row] = 5.0
    packed = _module.pack_gemm_weight(w)
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            ids, logprobs, _ = _module.packed_gemm_greedy(x, packed, None, n)
        finally:
            torch.set_num_threads(before)
        assert ids.tolist() == [3, 14, 31, 700, 1023, 2100]
        want_ids, want_logprobs = _sampled(_module.packed_gemm(x, packed, None, n))
        assert torch.equal(ids, want_ids) and torch.equal(logprobs, want_logprobs)


@pytest.mark.parametrize(("dtype", "amx"), _cases())
@torch.no_grad()
def test_a_rows_choice_does_not_depend_on_the_rows_beside_it(dtype: torch.dtype, amx: bool) -> None:
    if dtype == torch.float32 and (_module is None or not _module.gemm_isa()[1]):
        pytest.skip("native AVX-512 float32 GEMM not built")
    if dtype == torch.bfloat16 and (_module is None or not _module.gemm_bf16_available()):
        pytest.skip("native bfloat16 GEMM not built")
    assert _module is not None
    gen = torch.Generator().manual_seed(5)
    n, k = 3000, 96
    packed = _module.pack_gemm_weight((torch.randn(n, k, generator=gen) * 0.2).to(dtype))
    x = torch.randn(70, k, generator=gen).to(dtype)
    with _tiles(amx):
        ids, logprobs, _ = _module.packed_gemm_greedy(x, packed, None, n)
        for rows in (slice(0, 1), slice(5, 38), slice(69, 70)):
            alone_ids, alone_logprobs, _ = _module.packed_gemm_greedy(x[rows], packed, None, n)
            assert torch.equal(alone_ids, ids[rows])
            assert torch.equal(alone_logprobs, logprobs[rows])


@needs_avx512_float32_gemm
@torch.no_grad()
def test_a_row_with_a_nan_or_an_infinity_is_reported_not_folded() -> None:
    """finite is False for exactly the rows whose logits hold a NaN or an infinity (the caller
    samples those from the logits, whose semantics define them); the other rows are unharmed."""
    assert _module is not None
    gen = torch.Generator().manual_seed(9)
    n, k = 2100, 32
    w = torch.randn(n, k, generator=gen) * 0.1
    w[2050, 0] = 3e38  # a column whose logit overflows wherever x[:, 0] is large
    x = torch.randn(4, k, generator=gen)
    x[0, 0], x[3, 0] = 10.0, -10.0  # +inf, -inf
    x[1, 5] = float("nan")  # every logit NaN
    x[2, 0] = 0.0  # this row misses the large weight: finite
    packed = _module.pack_gemm_weight(w)
    ids, logprobs, finite = _module.packed_gemm_greedy(x, packed, None, n)
    assert finite.tolist() == [False, False, True, False]
    want_ids, want_logprobs = _sampled(_module.packed_gemm(x[2:3], packed, None, n))
    assert ids[2] == want_ids[0] and logprobs[2] == want_logprobs[0]


@needs_avx512_float32_gemm
@torch.no_grad()
def test_the_fold_refuses_what_it_does_not_serve() -> None:
    assert _module is not None
    w = torch.randn(64, 32)
    packed = _module.pack_gemm_weight(w)
    with pytest.raises(RuntimeError, match="K > 0"):
        _module.packed_gemm_greedy(torch.randn(2, 0), packed, None, 64)
    with pytest.raises(RuntimeError, match="N does not match"):
        _module.packed_gemm_greedy(torch.randn(2, 32), packed, None, 100)
    with pytest.raises(RuntimeError, match="x must be"):
        _module.packed_gemm_greedy(torch.randn(32), packed, None, 64)


@needs_avx512_float32_gemm
@torch.no_grad()
def test_the_backend_folds_a_packed_heads_choice_where_it_can() -> None:
    """greedy_logits gives sample()'s answer over float32_logits for packed heads (a linear,
    released or not, and a tied one) and None for anything else (a paired weight, an unpacked
    linear, the torch backend, a row with a NaN)."""
    torch.manual_seed(7)
    dtype = torch.bfloat16 if _module is not None and _module.gemm_bf16_available() else None
    model = nn.Module()
    model.lm_head = nn.Linear(64, 1500, bias=False)
    model.embed = nn.Embedding(1500, 64)
    model.tied = TiedLinear(model.embed)
    model.gate_up_proj = nn.Linear(64, 100, bias=False)
    if dtype is not None:
        model.bf16_head = nn.Linear(64, 1500, bias=False, dtype=dtype)
    plain = nn.Linear(64, 1500, bias=False)
    prepack_linears(model)
    backend = cpu_backend()
    x = torch.randn(5, 64)
    heads = [(model.lm_head, x), (model.tied, x)]
    if dtype is not None:
        heads.append((model.bf16_head, x.to(dtype)))
    for head, rows in heads:
        folded = backend.greedy_logits(head, rows)
        assert folded is not None
        want = _sampled(backend.float32_logits(head, rows))
        assert torch.equal(folded[0], want[0]) and torch.equal(folded[1], want[1])
    pack = model.lm_head._pack
    assert isinstance(pack, PackedWeight)
    pack.release_plain()
    folded = backend.greedy_logits(model.lm_head, x)
    assert folded is not None and torch.equal(folded[0], _sampled(model.lm_head(x))[0])
    assert greedy_linear(model.gate_up_proj, x) is None  # paired for its SwiGLU
    assert greedy_linear(plain, x) is None  # not packed
    assert greedy_linear(model.lm_head, x.double()) is None  # not its dtype
    assert torch_backend().greedy_logits(model.lm_head, x) is None
    nan_rows = x.clone()
    nan_rows[1, 0] = float("nan")
    assert backend.greedy_logits(model.lm_head, nan_rows) is None
    with pytest.raises(ValueError, match="plain weight"):
        model.gate_up_proj._pack.greedy(x)


def _run_steps(
    dtype: str, settings: list[Sampling]
) -> tuple[list[tuple[list[int], list[float]]], int]:
    """Four prompts prefilled on a fresh tiny engine, then three decode steps with the given
    sampling per item (``decode_with``), and how many times the model computed logits
    (compute_logits) in all."""
    engine = Engine(EngineConfig(model="tiny", dtype=dtype, kv_cache_bytes=16 * 1024**2))
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 200) for _ in range(5 + 3 * i)] for i in range(4)]
    computed = 0
    compute_logits = LlamaForCausalLM.compute_logits

    def counted(model: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
        nonlocal computed
        computed += 1
        return compute_logits(model, hidden)

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(LlamaForCausalLM, "compute_logits", counted)
            out = decode_with(engine, prompts, settings, 3)
    finally:
        engine.shutdown()
    return out, computed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_runner_folds_plain_greedy_steps_alone_with_the_same_answers(dtype: str) -> None:
    """Steps whose every output row is a plain argmax never compute logits (on the CPU fast
    path); a step with a row asking for top log-probs, a sampled row or a row asking for its
    logits does. The greedy rows' tokens and log-probs are the same bits either way."""
    if dtype == "float32" and (_module is None or not _module.gemm_isa()[1]):
        pytest.skip("native AVX-512 float32 GEMM not built")
    if dtype == "bfloat16" and (_module is None or not _module.gemm_bf16_available()):
        pytest.skip("native bfloat16 GEMM not built")
    folded, computed = _run_steps(dtype, [GREEDY] * 4)
    assert computed == 0  # the prefill's final chunks too: every row greedy
    for other in (
        Sampling(num_logprobs=2),
        Sampling(temperature=0.8, seed=1),
        Sampling(policy=OutputPolicy.LOGITS),
    ):
        mixed, computed = _run_steps(dtype, [GREEDY, GREEDY, other, GREEDY])
        assert computed == 3  # each decode step (the prefill's rows are all greedy)
        for i in (0, 1, 3):
            assert mixed[i] == folded[i]


@needs_avx512_float32_gemm
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
@torch.no_grad()
def test_soft_capped_logits_are_sampled_not_folded(
    family: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Gemma 2 caps its final logits (their log-normaliser is not the head's): its model
    declines the fold; Gemma 3 (no final cap) folds, with sample()'s answer."""
    folder = tmp_path_factory.mktemp(family)
    save_gemma(folder, family, 256)
    engine = Engine(EngineConfig(model=str(folder), kv_cache_bytes=2 * 1024**2))
    try:
        model = engine.model
        hidden = torch.randn(3, 64)
        folded = engine.call_sync(model.greedy_tokens, hidden)
        if family == "gemma2":
            assert folded is None
        else:
            assert folded is not None
            want = _sampled(engine.call_sync(model.compute_logits, hidden))
            assert torch.equal(folded[0], want[0]) and torch.equal(folded[1], want[1])
    finally:
        engine.shutdown()
