"""The native decode attention over items that share a cached prompt's blocks (prefix caching):
in bfloat16 the shared keys' part of every such item's softmax runs for all of them at once (on
AMX tiles where the CPU has them, else on vdpbf16ps register tiles), and each item reads only
its own keys after them. Checked against the torch reference and against the per-item path
(set_shared_prompt off), and the rule that picks the runs."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import pytest
import torch
from ferrum_kernels import native
from ferrum_kernels.cpu_decode import decode_attention, native_available
from helpers_native import paged_decode_reference, scattered_tables

pytestmark = pytest.mark.skipif(not native_available(), reason="no C++ toolchain")


@pytest.fixture
def amx_restored() -> Iterator[None]:
    module = native.load()
    before = module.set_amx(True)
    shared = module.set_shared_prompt(True)
    try:
        yield
    finally:
        module.set_amx(before)
        module.set_shared_prompt(shared)


# A step's shape: block, KV heads, query heads, head_dim, shared prompt tokens, items sharing
# it, items of their own.
Shape = tuple[int, int, int, int, int, int, int]


def _step(
    shape: Shape, query_scale: float = 1.0, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, ...]:
    """A decode step (bfloat16 unless `dtype`): `sharing` items whose tables start with the same
    prefix // block blocks, with `others` items of their own in the middle of them (so two
    runs)."""
    block, kv_heads, heads, head_dim, prefix, sharing, others = shape
    torch.manual_seed(0)
    rng = random.Random(0)
    contexts = [prefix + rng.randint(1, 40) for _ in range(sharing)]
    contexts += [rng.randint(1, 90) for _ in range(others)]
    tables, num_blocks = scattered_tables(contexts, block, rng)
    kv = torch.randn(2, num_blocks, block, kv_heads, head_dim).to(dtype)
    shared = prefix // block
    for i in range(1, sharing):
        tables[i] = tables[0][:shared] + tables[i][shared:]
    order = [*range(sharing // 2), *range(sharing, sharing + others), *range(sharing // 2, sharing)]
    contexts = [contexts[i] for i in order]
    tables = [tables[i] for i in order]
    query = (torch.randn(len(contexts), heads, head_dim) * query_scale).to(dtype)
    table, want = paged_decode_reference(query, kv, tables, contexts, block)
    return query, kv, table, torch.tensor(contexts), want


@pytest.mark.parametrize(
    "shape",
    # W1's shapes under w2-prefix's shared prompt; a prefix that is no multiple of 32 keys (its
    # last 8 read per item); 128-wide heads with more query rows than a tile; one KV head for
    # all (G = 4) with 4-token blocks and a partial last tile of rows; no GQA, over a chunk
    # of 256 keys and a last one of 64 (320 shared).
    [
        (16, 4, 12, 64, 1024, 16, 3),
        (8, 2, 8, 128, 200, 5, 0),
        (16, 8, 32, 128, 512, 9, 1),
        (4, 1, 4, 32, 64, 3, 4),
        (16, 4, 4, 64, 336, 4, 0),
    ],
)
# A peaked softmax too: the shared keys' max and an item's own far apart when merged.
@pytest.mark.parametrize("query_scale", [1.0, 60.0])
# The shared keys on AMX tiles where the CPU has them, and on the register tiles (everywhere);
# float32 on register tiles with FMAs.
@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_items_sharing_a_prompt_match_the_reference(
    amx_restored: None, amx: bool, dtype: torch.dtype, shape: Shape, query_scale: float
) -> None:
    query, kv, table, lens, want = _step(shape, query_scale, dtype)
    head_dim = shape[3]
    rows = torch.arange(len(lens))
    module = native.load()
    module.set_amx(amx)
    got = decode_attention(query, kv, table, lens, rows, head_dim**-0.5)
    assert module.set_shared_prompt(False)  # every item reads all its keys itself
    alone = decode_attention(query, kv, table, lens, rows, head_dim**-0.5)
    assert got is not None and alone is not None
    bf16 = dtype == torch.bfloat16
    # bfloat16 outputs (and probabilities rounded to bfloat16 in both kernels): a few ulps.
    # float32 throughout: the sums differ only in their order (a peaked softmax's scores are
    # large, so their last bits weigh up to 1e-4 there).
    tolerance = {"atol": 2e-2, "rtol": 0.0} if bf16 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(got.float(), want.float(), **tolerance)
    torch.testing.assert_close(got.float(), alone.float(), **tolerance)
    if module.shared_prompt_available(bf16):  # the shared keys went through the partials
        assert not torch.equal(got, alone)


def test_the_shared_runs_are_whole_blocks_before_every_items_last_key() -> None:
    runs = native.load().decode_shared_prefixes
    block = 16
    base = list(range(100, 110))

    def own(n: int, start: int) -> list[int]:
        return list(range(start, start + n))

    # Four items sharing five blocks (80 keys): 64 of them, whole steps of 32 keys.
    tables = [base[:5] + own(2, 200 + 10 * i) for i in range(4)]
    lens = [7 * block - 3] * 4
    assert runs(torch.tensor(tables), torch.tensor(lens), block).tolist() == [[0, 4, 64]]
    # An item of its own in the middle: two runs (each of two items or more).
    mixed = [*tables[:2], own(7, 300), *tables[2:]]
    got = runs(torch.tensor(mixed), torch.tensor([7 * block - 3] * 5), block).tolist()
    assert got == [[0, 2, 64], [3, 2, 64]]
    # An item whose last key lies in the shared blocks: only the blocks before it count, and
    # the run's keys are every item's least (65 keys -> 4 whole blocks -> 64).
    short = [[*base[:5], 0, 0, 0]] + [base[:7] + own(1, 400)] * 2  # the first padded
    got = runs(torch.tensor(short), torch.tensor([65, 7 * block + 5, 7 * block + 5]), block)
    assert got.tolist() == [[0, 3, 64]]
    # Under 64 shared keys, or a single item: no run.
    few = [base[:3] + own(4, 500 + 10 * i) for i in range(3)]
    assert runs(torch.tensor(few), torch.tensor([7 * block] * 3), block).numel() == 0
    assert runs(torch.tensor(tables[:1]), torch.tensor(lens[:1]), block).numel() == 0
    with pytest.raises(RuntimeError, match="lens"):
        runs(torch.tensor(tables), torch.tensor(lens, dtype=torch.int32), block)
    with pytest.raises(RuntimeError, match="within its table"):
        runs(torch.tensor(tables), torch.tensor([20 * block] * 4), block)


def _prefill_case(
    block: int, kv_heads: int, group: int, head_dim: int, prompt: int, suffixes: list[int]
) -> tuple[torch.Tensor, ...]:
    """Prompt chunks (bfloat16), each a request's own `suffix` tokens after a cached prompt of
    `prompt` tokens whose blocks every chunk's table starts with; the last chunk has a cached
    prompt of its own (no sharing). Returns q [T, H, D], the pools, chunks [C, 3], tables and
    the float64 causal answer."""
    torch.manual_seed(1)
    heads = kv_heads * group
    contexts = [prompt + s for s in suffixes] + [prompt // 2 + suffixes[-1]]
    sizes = [*suffixes, suffixes[-1]]
    blocks = [math.ceil(c / block) for c in contexts]
    shared = prompt // block
    pool_blocks = shared + sum(b - shared for b in blocks) + shared + 2
    k_pool = torch.randn(pool_blocks, block, kv_heads, head_dim).to(torch.bfloat16)
    v_pool = torch.randn(pool_blocks, block, kv_heads, head_dim).to(torch.bfloat16)
    free = iter(range(shared, pool_blocks))
    tables = [list(range(shared)) + [next(free) for _ in range(b - shared)] for b in blocks[:-1]]
    tables.append([next(free) for _ in range(blocks[-1])])
    width = max(blocks)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(sum(sizes), heads, head_dim).to(torch.bfloat16)
    chunks, want, start = [], torch.zeros(q.shape, dtype=torch.float64), 0
    for table_row, ctx, n in zip(tables, contexts, sizes, strict=True):
        chunks.append([start, start + n, ctx])
        slots = torch.tensor([table_row[t // block] * block + t % block for t in range(ctx)])
        keys = k_pool.view(-1, kv_heads, head_dim)[slots].double()  # [ctx, Hkv, D]
        values = v_pool.view(-1, kv_heads, head_dim)[slots].double()
        for i in range(n):
            pos = ctx - n + i
            rows = q[start + i].double().view(kv_heads, group, head_dim)
            scores = torch.einsum("hgd,khd->hgk", rows, keys[: pos + 1]) * head_dim**-0.5
            weights = scores.softmax(-1)
            want[start + i] = torch.einsum("hgk,khd->hgd", weights, values[: pos + 1]).reshape(
                heads, head_dim
            )
        start += n
    return q, k_pool, v_pool, torch.tensor(chunks), table, want


@pytest.mark.parametrize(
    ("block", "kv_heads", "group", "head_dim", "prompt", "suffixes"),
    # w2-prefix's shape (a 1,024-token prompt, W1's heads); a prompt that is no multiple of 32
    # keys (its last 16 stay with each chunk); 128-wide heads, one KV head for all.
    [
        (16, 4, 3, 64, 1024, [37, 80, 5]),
        (16, 2, 2, 64, 336, [20, 33]),
        (8, 1, 4, 128, 200, [17, 9, 40]),
    ],
)
def test_prompt_chunks_sharing_a_cached_prompt_match_the_reference(
    amx_restored: None,
    block: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    prompt: int,
    suffixes: list[int],
) -> None:
    """Prefill chunks continuing one cached prompt: on AMX its keys' part of every chunk row's
    softmax is computed once and merged; the chunks' own keys, causal, as before. (On register
    tiles the chunks score the prompt themselves: the partials measured level there.)"""
    q, k_pool, v_pool, chunks, table, want = _prefill_case(
        block, kv_heads, group, head_dim, prompt, suffixes
    )
    module = native.load()

    def run() -> torch.Tensor:
        out = torch.zeros_like(q)
        keys = sum(-(-int(c) // 16) * 16 for c in chunks[:, 2])  # every chunk's, in tiles
        scratch = torch.empty(keys * kv_heads * head_dim * 2, dtype=torch.bfloat16)
        module.prefill_attention(
            q, k_pool, v_pool, out, chunks, table, scratch, block, kv_heads, head_dim**-0.5, 0
        )
        return out

    got = run()
    assert module.set_shared_prompt(False)  # every chunk over all its keys
    alone = run()
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=0)
    torch.testing.assert_close(alone.double(), want, atol=2e-2, rtol=0)
    if module.amx_available():  # the shared prompt went through the partials
        assert not torch.equal(got, alone)
