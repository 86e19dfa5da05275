"""Test helpers: a toy block allocator and a paged runner that drives a model step by step.

Test modules import this after putting ``tests/`` on ``sys.path`` (see ``import_helpers``
boilerplate at the top of each test file).
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from ferrum_kernels.attention import AttentionMetadata, OutputRows
from ferrum_server.models.causal_lm import CausalLM
from ferrum_server.models.config import ModelConfig


class BlockAllocator:
    """Hands out block ids from a free list, in order or shuffled (to get non-contiguous tables)."""

    def __init__(self, num_blocks: int, *, shuffle: bool = False, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        if shuffle:
            random.Random(seed).shuffle(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"out of KV blocks: need {n}, have {len(self.free)}")
        out, self.free = self.free[:n], self.free[n:]
        return out


@dataclass
class SeqState:
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens already written to the cache


def build_meta(
    block_lists: list[list[int]],
    query_lens: list[int],
    context_lens: list[int],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata for items whose newest query_lens[i] tokens end at context_lens[i]."""
    query_start = [0]
    for n in query_lens:
        query_start.append(query_start[-1] + n)
    max_blocks = max((len(b) for b in block_lists), default=0)
    table = torch.zeros(len(block_lists), max(max_blocks, 1), dtype=torch.int64)
    for i, blocks in enumerate(block_lists):
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
    slots: list[int] = []
    for blocks, n, ctx in zip(block_lists, query_lens, context_lens, strict=True):
        for pos in range(ctx - n, ctx):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    return AttentionMetadata.build(
        query_start,
        context_lens,
        table.to(device),
        torch.tensor(slots, dtype=torch.int64, device=device),
    )


class PagedRunner:
    """Owns a KV pool and a set of sequences; ``step`` runs one unified forward pass."""

    def __init__(
        self,
        model: CausalLM,
        config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        self.model, self.config, self.block_size = model, config, block_size
        weight = model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.kv_cache = torch.zeros(
            config.num_layers,
            2,
            num_blocks,
            block_size,
            model.kv_heads,  # this rank's KV heads (config.num_kv_heads unless split)
            config.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.allocator = BlockAllocator(num_blocks, shuffle=shuffle, seed=seed)
        self.seqs: dict[int, SeqState] = {}

    @torch.no_grad()
    def step(self, items: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Feed tokens to sequences (created on first use); per-item logits [n_i, vocab]."""
        hidden, meta = self.forward(items)
        logits = self.model.compute_logits(hidden)  # [T, vocab]
        return [logits[meta.query_start[i] : meta.query_start[i + 1]] for i in range(len(items))]

    @torch.no_grad()
    def forward(
        self, items: list[tuple[int, list[int]]], counts: list[int] | None = None
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """``step``'s forward: the final hidden states of every query row [T, hidden], or, as
        the engine runs a step, of each item's last ``counts[i]`` rows alone (``OutputRows``:
        the last layer finishes only those) [R, hidden]; and the step's metadata."""
        ids: list[int] = []
        positions: list[int] = []
        block_lists, query_lens, context_lens = [], [], []
        for seq_id, tokens in items:
            seq = self.seqs.setdefault(seq_id, SeqState())
            new_len = seq.length + len(tokens)
            need = math.ceil(new_len / self.block_size) - len(seq.blocks)
            if need > 0:
                seq.blocks += self.allocator.allocate(need)
            ids += tokens
            positions += range(seq.length, new_len)
            block_lists.append(list(seq.blocks))
            query_lens.append(len(tokens))
            context_lens.append(new_len)
            seq.length = new_len
        meta = build_meta(block_lists, query_lens, context_lens, self.block_size, self.device)
        args = [
            torch.tensor(ids, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            self.kv_cache,
            meta,
        ]
        if counts is not None:
            args.append(OutputRows.select(meta, counts))
        hidden: torch.Tensor = self.model(*args)
        return hidden, meta

    def snapshot(self) -> tuple[torch.Tensor, dict[int, SeqState], list[int]]:
        return self.kv_cache.clone(), copy.deepcopy(self.seqs), list(self.allocator.free)

    def restore(self, snap: tuple[torch.Tensor, dict[int, SeqState], list[int]]) -> None:
        self.kv_cache.copy_(snap[0])
        self.seqs = copy.deepcopy(snap[1])
        self.allocator.free = list(snap[2])


def dense_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q [n, H, D] (the last n of ctx positions), k/v [ctx, Hkv, D] -> [n, H, D], in float64.
    window > 0: a query at position p sees only keys in (p - window, p]. softcap > 0: scores s
    become softcap * tanh(s / softcap) before the softmax."""
    n, num_heads, _ = q.shape
    ctx, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.double().repeat_interleave(group, dim=1)  # [ctx, H, D]
    v = v.double().repeat_interleave(group, dim=1)  # [ctx, H, D]
    scores = torch.einsum("nhd,chd->hnc", q.double(), k) * scale  # [H, n, ctx]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(ctx - n, ctx)[:, None]  # [n, 1]
    allowed = torch.arange(ctx)[None, :] <= q_pos  # [n, ctx]
    if window:
        allowed &= torch.arange(ctx)[None, :] > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1), v)  # [n, H, D]


@torch.no_grad()
def check_greedy_against_transformers(
    tmp_path: Path,
    hf_config: Any,  # a transformers LlamaConfig
    *,
    prompt_len: int,
    chunk_ends: list[int],
    steps: int,
    num_blocks: int,
    block_size: int,
) -> ModelConfig:
    """Random-initialise a transformers model from `hf_config`, load the same weights into ours
    with the CPU fast paths on, prefill a random prompt in chunks ending at `chunk_ends`, then
    decode `steps` greedy tokens: at every step the last row's logits agree within 1e-3 and
    both pick the same token. Returns our model's config."""
    from ferrum_kernels.backend import cpu_backend
    from ferrum_server.models import load_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model, config = load_model(str(tmp_path), dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(config, ModelConfig)
    model.bind_backend(cpu_backend())
    runner = PagedRunner(model, config, num_blocks=num_blocks, block_size=block_size, shuffle=True)
    prompt = torch.randint(0, hf_config.vocab_size, (prompt_len,))
    assert chunk_ends[-1] == prompt_len
    begin = 0
    for end in chunk_ends:
        ours = runner.step([(0, prompt[begin:end].tolist())])[0][-1]
        begin = end
    out = hf(input_ids=prompt[None], use_cache=True)
    ref, past = out.logits[0, -1].float(), out.past_key_values
    for _ in range(steps):
        assert (ours - ref).abs().max().item() <= 1e-3
        token = int(ref.argmax())
        assert int(ours.argmax()) == token
        ours = runner.step([(0, [token])])[0][-1]
        out = hf(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
        ref, past = out.logits[0, -1].float(), out.past_key_values
    return config


@dataclass
class PagedBatch:
    """A random mixed step over a paged pool, with its float64 dense answer."""

    kv_layer: torch.Tensor  # [2, NB, BS, Hkv, D]: every item's history and this step's K/V
    meta: AttentionMetadata
    queries: list[torch.Tensor]  # per item [n, H, D]
    key: torch.Tensor  # [T, Hkv, D] this step's keys (already written to the pool)
    value: torch.Tensor  # [T, Hkv, D]
    reference: torch.Tensor  # [T, H, D] float64 dense causal attention
    scale: float


def random_paged_batch(
    items: list[tuple[int, int]],  # (history length, query rows) per item; 1 row = a decode
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    shuffle: bool = True,
    spare_blocks: int = 3,
    spare_fill: float | None = None,
    device: torch.device | str = "cpu",
    window: int = 0,
    softcap: float = 0.0,
) -> PagedBatch:
    """Items' histories go straight into a pool of shuffled blocks, then this step's K/V are
    written as the model would; `spare_blocks` unowned blocks hold random values, or
    `spare_fill` (e.g. NaN, so that any read of them shows). `window` > 0: the dense answer
    is sliding-window attention; `softcap` > 0: with soft-capped scores."""
    from ferrum_kernels.attention import write_kv

    torch.manual_seed(seed)
    num_heads = num_kv_heads * group
    owned = sum(math.ceil((h + n) / block_size) for h, n in items)
    kv_layer = torch.randn(2, owned + spare_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    if spare_fill is not None and spare_blocks:
        kv_layer[:, owned:] = spare_fill
    allocator = BlockAllocator(owned, shuffle=shuffle, seed=seed)
    block_lists, query_lens, context_lens = [], [], []
    full_k, full_v, queries = [], [], []
    for hist, n in items:
        ctx = hist + n
        blocks = allocator.allocate(math.ceil(ctx / block_size))
        k = torch.randn(ctx, num_kv_heads, head_dim).to(dtype)  # [ctx, Hkv, D]
        v = torch.randn(ctx, num_kv_heads, head_dim).to(dtype)
        for p in range(hist):  # history goes straight into the pool
            kv_layer[0, blocks[p // block_size], p % block_size] = k[p]
            kv_layer[1, blocks[p // block_size], p % block_size] = v[p]
        block_lists.append(blocks)
        query_lens.append(n)
        context_lens.append(ctx)
        full_k.append(k)
        full_v.append(v)
        queries.append(torch.randn(n, num_heads, head_dim).to(dtype))
    meta = build_meta(block_lists, query_lens, context_lens, block_size, device)
    kv_layer = kv_layer.to(device)
    key = torch.cat([k[h:] for k, (h, _) in zip(full_k, items, strict=True)])  # [T, Hkv, D]
    value = torch.cat([v[h:] for v, (h, _) in zip(full_v, items, strict=True)])
    key, value = key.to(device), value.to(device)
    write_kv(kv_layer, key, value, meta.slot_mapping)
    scale = head_dim**-0.5
    reference = torch.cat(
        [
            dense_reference(q, k, v, scale, window, softcap)
            for q, k, v in zip(queries, full_k, full_v, strict=True)
        ]
    )
    return PagedBatch(kv_layer, meta, queries, key, value, reference, scale)


def save_windowed_mistral(folder: Path, window: int, vocab: int, **extra: Any) -> torch.nn.Module:
    """A small random Mistral whose sliding window is `window`, saved to `folder` (seed 0)."""
    from transformers import AutoModelForCausalLM, MistralConfig

    config = MistralConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=window,
        initializer_range=0.08,
        **extra,
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(folder, safe_serialization=True)
    return hf


def hf_greedy(hf: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """transformers' greedy continuation (steps tokens), one cached step at a time."""
    out = hf(input_ids=torch.tensor([prompt]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(steps - 1):
        out = hf(
            input_ids=torch.tensor([[tokens[-1]]]),
            past_key_values=out.past_key_values,
            use_cache=True,
        )
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


# Phi-3's LongRoPE in tests: factors that differ per frequency and between the two lists, so
# that picking the wrong list, or none, moves the logits well past the parity tolerance.
def longrope_scaling(head_dim: int) -> dict[str, Any]:
    pairs = head_dim // 2
    return {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(pairs)],
        "long_factor": [1.0 + 0.5 * i for i in range(pairs)],
    }


def phi3_config(vocab: int = 256, **extra: Any) -> Any:
    """A small transformers Phi3Config (head_dim 32: a size the native CPU kernels take)."""
    from transformers import Phi3Config

    fields: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 256,
        "initializer_range": 0.08,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": None,
    }
    return Phi3Config(**(fields | extra))


def save_phi3(folder: Path, vocab: int = 256, **extra: Any) -> torch.nn.Module:
    """A small random Phi-3 (``phi3_config(**extra)``) saved to `folder` (seed 0)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(phi3_config(vocab, **extra), dtype=torch.float32).eval()
    with torch.no_grad():  # norms start at 1, which would hide a norm loaded wrongly
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    hf.save_pretrained(folder, safe_serialization=True)
    return hf


# Gemma test checkpoints: small, windows well inside a 20-token prompt, and every Gemma
# hyper-parameter set to a value that changes the logits (a model ignoring one fails parity).
GEMMA_WINDOW = 6
GEMMA_FAMILIES = ("gemma2", "gemma3")


def gemma_hf_config(family: str, vocab: int = 256, **extra: Any) -> Any:
    """A small transformers Gemma2Config / Gemma3TextConfig.

    gemma2: 3 layers (sliding, global, sliding), attention and final logit soft-caps small
    enough to bite, q/k/v/o biases. gemma3: 4 layers (sliding, sliding, global, sliding:
    sliding_window_pattern 3), q/k norms, RoPE base 1000 on sliding layers and 100000 with
    linear scaling x4 on the global one. Both: query_pre_attn_scalar 24 (not head_dim), GQA 2.
    """
    from transformers import Gemma2Config, Gemma3TextConfig

    common: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.08,
        "sliding_window": GEMMA_WINDOW,
        "query_pre_attn_scalar": 24,
    }
    common.update(extra)
    if family == "gemma2":
        return Gemma2Config(
            **common,
            num_hidden_layers=3,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            attention_bias=True,
        )
    if family == "gemma3":
        return Gemma3TextConfig(
            **common,
            num_hidden_layers=4,
            sliding_window_pattern=3,
            rope_theta=100_000.0,
            rope_local_base_freq=1_000.0,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
        )
    raise ValueError(f"unknown Gemma family {family!r}")


@torch.no_grad()
def save_gemma(folder: Path, family: str, vocab: int = 256, **extra: Any) -> torch.nn.Module:
    """A random Gemma (seed 0) saved to `folder`; its norm weights and biases are randomised
    (transformers initialises them to 0, which would hide a (1 + w) or bias mistake)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(
        gemma_hf_config(family, vocab, **extra), dtype=torch.float32
    )
    for name, p in hf.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(0.2 * torch.randn_like(p))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn_like(p))
    hf.save_pretrained(folder, safe_serialization=True)
    return hf.eval()


def check_chunking_and_batching_invariance(make_runner: Any) -> None:
    """Chunked prefill of a 23-token prompt equals one piece, and a mixed batch (chunks on
    history, decodes past it) equals each item alone. ``make_runner(**kw)`` builds a fresh
    ``PagedRunner`` (kw: ``shuffle``, ``seed``). Uses torch's global seed (the caller sets it)."""
    prompt = torch.randint(0, 256, (23,)).tolist()
    whole = make_runner(shuffle=False).step([(0, prompt)])[0]
    for chunks in ([12, 11], [5, 5, 5, 5, 3], [1, 7, 15]):
        runner = make_runner(seed=5)
        start, rows = 0, []
        for n in chunks:
            rows.append(runner.step([(0, prompt[start : start + n])])[0])
            start += n
        torch.testing.assert_close(torch.cat(rows), whole, atol=1e-4, rtol=0)

    runner = make_runner()
    plan = [(10, 1, 1), (11, 0, 9), (12, 4, 1), (13, 5, 8), (14, 30, 1), (15, 17, 3)]
    for seq_id, hist, _ in plan:
        if hist:
            runner.step([(seq_id, torch.randint(0, 256, (hist,)).tolist())])
    new = {seq_id: torch.randint(0, 256, (n,)).tolist() for seq_id, _, n in plan}
    snap = runner.snapshot()
    batched = runner.step([(seq_id, new[seq_id]) for seq_id, _, _ in plan])
    for (seq_id, _, _), got in zip(plan, batched, strict=True):
        runner.restore(snap)
        alone = runner.step([(seq_id, new[seq_id])])[0]
        torch.testing.assert_close(got, alone, atol=1e-4, rtol=0)
