"""Batched next-token sampling that runs on the executor, so only token ids cross the wire.

Every operation is vectorised over the rows of the batch and works on CPU and CUDA tensors alike;
nothing in ``sample`` reads a tensor value back to the host.

Randomness is counter-based: the noise for token ``t`` of a row is a pure function of
``(seed, offset, t)``, computed with 64-bit integer mixing on the device. A request therefore draws
the same token for the same (seed, position) whatever else shares its batch, wherever the row sits
in it, and whether or not the batch needed the top-k/top-p sort.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ferrum_kernels import native
from ferrum_kernels.transfer import to_device

__all__ = [
    "GREEDY_TEMPERATURE_FLOOR",
    "SampleOutput",
    "SamplingTensors",
    "build_sampling_tensors",
    "penalty_mask_from_ids",
    "sample",
    "unpack_bitmask",
]

_U64 = 1 << 64
_I64_MIN = -(1 << 63)
# Temperatures below this are greedy. Dividing float32 logits by a temperature near 1e-39 (or a
# denormal such as 1e-45) overflows them to inf, and the draw then picks an arbitrary token;
# from here down, sampling is indistinguishable from greedy anyway (logit gaps of 1e-4 already
# scale to 10).
GREEDY_TEMPERATURE_FLOOR = 1e-5


def _as_i64(value: int) -> int:
    """Reinterpret an arbitrary Python int as the two's-complement int64 with the same low bits."""
    return ((value - _I64_MIN) % _U64) + _I64_MIN


# splitmix64 constants, stored as signed int64 because torch has no uint64 arithmetic.
_GOLDEN = _as_i64(0x9E3779B97F4A7C15)
_MIX1 = _as_i64(0xBF58476D1CE4E5B9)
_MIX2 = _as_i64(0x94D049BB133111EB)
# Distinguishes the per-token stream from the (seed, offset) key derivation.
_OFFSET_SALT = _as_i64(0xD1B54A32D192ED03)

# 23 random bits: (v + 0.5) * 2**-23 is then exact in float32 and lies strictly inside (0, 1);
# with 24 bits the top value would round to 1.0 and the Gumbel transform would return +inf.
_UNIFORM_BITS = 23


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per-row sampling parameters for one batch, already on the logits' device."""

    temperature: Tensor  # [N] float32; <= 0 => greedy (argmax); never in (0, 1e-5)
    top_k: Tensor  # [N] int64; <= 0 (or >= V) => disabled
    top_p: Tensor  # [N] float32; >= 1.0 => disabled
    seeds: Tensor  # [N] int64; per-request seed
    offsets: Tensor  # [N] int64; per-row noise counter (the token position)
    repetition_penalty: Tensor  # [N] float32; 1.0 => off
    penalty_mask: Tensor | None  # [N, V] bool: tokens seen in the row's context, or None
    token_mask: Tensor | None  # [N, V] bool: True = allowed, or None when no row masks
    num_logprobs: int  # max top-n log-probs requested by any row (0 = none)
    all_greedy: bool  # every row is greedy: skip the sampling path entirely
    # False only when the builder knows no sampled row uses top-k/top-p, letting `sample` skip
    # the [N, V] sort. True is always correct (filters then just keep every token).
    needs_top_k_top_p: bool = True

    @staticmethod
    def greedy(n: int, device: torch.device | str) -> SamplingTensors:
        """Parameters for ``n`` plain greedy rows: no penalty, no mask, no log-probs."""
        zeros_i = torch.zeros(n, dtype=torch.int64, device=device)
        ones_f = torch.ones(n, dtype=torch.float32, device=device)
        return SamplingTensors(
            temperature=torch.zeros(n, dtype=torch.float32, device=device),
            top_k=zeros_i,
            top_p=ones_f,
            seeds=zeros_i,
            offsets=zeros_i,
            repetition_penalty=ones_f,
            penalty_mask=None,
            token_mask=None,
            num_logprobs=0,
            all_greedy=True,
            needs_top_k_top_p=False,
        )


@dataclass(frozen=True, slots=True)
class SampleOutput:
    token_ids: Tensor  # [N] int64
    logprobs: Tensor  # [N] float32, chosen token under log_softmax of the raw logits
    top_ids: Tensor  # [N, num_logprobs] int64, raw distribution's top-n, descending
    top_logprobs: Tensor  # [N, num_logprobs] float32


# ----------------------------------------------------------------------------------------------
# Counter-based noise
# ----------------------------------------------------------------------------------------------


def _lsr(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64: torch's ``>>`` is arithmetic, so clear the sign-fill bits."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix64(x: Tensor) -> Tensor:
    """splitmix64 finaliser on int64 (multiplication wraps mod 2**64 on CPU and CUDA)."""
    z = x ^ _lsr(x, 30)  # fresh tensor, so the in-place ops below never touch the caller's
    z.mul_(_MIX1)
    z.bitwise_xor_(_lsr(z, 27))
    z.mul_(_MIX2)
    z.bitwise_xor_(_lsr(z, 31))
    return z


def _row_keys(seeds: Tensor, offsets: Tensor) -> Tensor:
    """One well-mixed 64-bit key per (seed, offset) pair."""
    key = _mix64(seeds + _GOLDEN)  # [N]
    return _mix64(key ^ (offsets * _OFFSET_SALT))  # [N]


def _gumbel_noise(seeds: Tensor, offsets: Tensor, token_ids: Tensor) -> Tensor:
    """Gumbel(0, 1) noise that depends only on (seed, offset, token id).

    seeds, offsets: [N] int64; token_ids: int64 broadcastable to [N, V]. Returns float32 [N, V].
    """
    keys = _row_keys(seeds, offsets)  # [N]
    # The token's splitmix64 stream position, so tokens of one row get independent draws.
    bits = _mix64(keys.unsqueeze(-1) + token_ids * _GOLDEN)  # [N, V] int64
    bits = _lsr(bits, 64 - _UNIFORM_BITS)  # [N, V] in [0, 2**23)
    u = bits.to(torch.float32).add_(0.5).mul_(2.0**-_UNIFORM_BITS)  # [N, V] in (0, 1)
    return u.log_().neg_().log_().neg_()  # [N, V] -log(-log(u))


# ----------------------------------------------------------------------------------------------
# Mask construction
# ----------------------------------------------------------------------------------------------


def penalty_mask_from_ids(ids: Tensor, counts: Tensor, vocab_size: int) -> Tensor:
    """Scatter ragged per-row token ids into an [N, V] bool mask.

    ids: flat int64 [sum(counts)], row i owning the next counts[i] entries; counts: [N] int64.
    Ids outside [0, vocab_size) are ignored rather than raising, so a stale id cannot crash a batch.
    """
    n = counts.shape[0]
    rows = torch.repeat_interleave(
        torch.arange(n, device=counts.device),
        counts,
        output_size=ids.shape[0],  # known statically: avoids a device->host sync on CUDA
    )  # [sum(counts)]
    in_range = (ids >= 0) & (ids < vocab_size)
    cols = torch.where(in_range, ids, vocab_size)  # out-of-range ids land in a spill column
    mask = torch.zeros(n, vocab_size + 1, dtype=torch.bool, device=ids.device)  # [N, V + 1]
    mask[rows, cols] = True
    return mask[:, :vocab_size]  # [N, V]


def unpack_bitmask(bits: Tensor, vocab_size: int) -> Tensor:
    """[N, ceil(V/8)] uint8, LSB-first (bit i % 8 of byte i // 8 is token i) -> [N, V] bool."""
    n, nbytes = bits.shape
    if nbytes * 8 < vocab_size:
        raise ValueError(f"bitmask has {nbytes} bytes per row, vocab {vocab_size} needs more")
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)  # [8]
    unpacked = (bits.unsqueeze(-1) >> shifts) & 1  # [N, B, 8]
    return unpacked.reshape(n, nbytes * 8)[:, :vocab_size].bool()  # [N, V]


# ----------------------------------------------------------------------------------------------
# Builder
# ----------------------------------------------------------------------------------------------


def build_sampling_tensors(
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    seeds: Sequence[int],
    offsets: Sequence[int],
    repetition_penalty: Sequence[float],
    penalty_ids: Sequence[Sequence[int]] | None,
    token_mask_bits: Sequence[bytes | None] | None,
    num_logprobs: int,
    vocab_size: int,
    device: torch.device | str,
    penalty_start: Sequence[int] | None = None,
) -> SamplingTensors:
    """Build a batch's SamplingTensors from host lists with at most three host->device copies.

    penalty_ids: per row, the token ids of its context (duplicates fine); ignored for rows whose
    penalty is 1.0. penalty_start: per row, the index into its penalty_ids from which tokens are
    penalised (the penalty's scope: 0 covers the whole context, the prompt length covers only
    the outputs); None = 0 for every row. token_mask_bits: per row, a ceil(V/8)-byte LSB-first
    allow-mask, or None for "everything allowed". Seeds may be any Python int (e.g. uint64);
    they are reduced mod 2**64.
    """
    dev = torch.device(device)
    n = len(temperature)
    lengths = {len(top_k), len(top_p), len(seeds), len(offsets), len(repetition_penalty)}
    if lengths != {n}:
        raise ValueError("per-row sampling parameter lists differ in length")
    if penalty_ids is not None and len(penalty_ids) != n:
        raise ValueError("penalty_ids has the wrong number of rows")
    if penalty_start is not None and len(penalty_start) != n:
        raise ValueError("penalty_start has the wrong number of rows")
    if penalty_start is not None and any(start < 0 for start in penalty_start):
        raise ValueError("penalty_start entries must be >= 0")
    if token_mask_bits is not None and len(token_mask_bits) != n:
        raise ValueError("token_mask_bits has the wrong number of rows")
    if num_logprobs < 0:
        raise ValueError("num_logprobs must be >= 0")

    temperature = [t if t >= GREEDY_TEMPERATURE_FLOOR else 0.0 for t in temperature]
    floats = torch.tensor(
        [temperature, list(top_p), list(repetition_penalty)], dtype=torch.float32
    ).reshape(3, n)  # [3, N]; reshape keeps the shape when n == 0

    # Only rows that actually penalise contribute ids: the others would scatter for nothing.
    penalising = [p != 1.0 for p in repetition_penalty]
    counts: list[int] = []
    flat_ids: list[int] = []
    if penalty_ids is not None and any(penalising):
        starts = penalty_start if penalty_start is not None else [0] * n
        # Each row's scope: its ids from its start on (a slice, no per-token loop).
        scoped = [
            ids[start:] if pen else ()
            for ids, start, pen in zip(penalty_ids, starts, penalising, strict=True)
        ]
        counts = [len(ids) for ids in scoped]
        flat_ids = list(itertools.chain.from_iterable(scoped))
    # Rows whose scope is empty (outputs only, before the first output) penalise nothing.
    with_penalty = any(counts)
    if not with_penalty:
        counts, flat_ids = [], []

    # All int64 data travels in one copy and is split into views on the device.
    ints_host = torch.tensor(
        [*top_k, *(_as_i64(s) for s in seeds), *offsets, *counts, *flat_ids], dtype=torch.int64
    )
    floats_dev = to_device(floats, dev)
    ints_dev = to_device(ints_host, dev)
    top_k_t = ints_dev[0:n]
    seeds_t = ints_dev[n : 2 * n]
    offsets_t = ints_dev[2 * n : 3 * n]

    penalty_mask: Tensor | None = None
    if with_penalty:
        counts_t = ints_dev[3 * n : 4 * n]
        penalty_mask = penalty_mask_from_ids(ints_dev[4 * n :], counts_t, vocab_size)

    token_mask: Tensor | None = None
    if token_mask_bits is not None and any(b is not None for b in token_mask_bits):
        nbytes = (vocab_size + 7) // 8
        for b in token_mask_bits:
            if b is not None and len(b) != nbytes:
                raise ValueError(f"token mask has {len(b)} bytes, expected {nbytes}")
        allow_all = b"\xff" * nbytes
        packed = b"".join(allow_all if b is None else b for b in token_mask_bits)
        bits_host = torch.frombuffer(bytearray(packed), dtype=torch.uint8).reshape(n, nbytes)
        token_mask = unpack_bitmask(to_device(bits_host, dev), vocab_size)

    sampled = [t > 0.0 for t in temperature]
    needs_filter = any(
        s and (0 < k < vocab_size or p < 1.0) for s, k, p in zip(sampled, top_k, top_p, strict=True)
    )
    return SamplingTensors(
        temperature=floats_dev[0],
        top_k=top_k_t,
        top_p=floats_dev[1],
        seeds=seeds_t,
        offsets=offsets_t,
        repetition_penalty=floats_dev[2],
        penalty_mask=penalty_mask,
        token_mask=token_mask,
        num_logprobs=num_logprobs,
        all_greedy=not any(sampled),
        needs_top_k_top_p=needs_filter,
    )


# ----------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------


def _apply_repetition_penalty(logits: Tensor, penalty: Tensor, seen: Tensor) -> Tensor:
    """HF convention: seen tokens with positive logits are divided, the rest multiplied."""
    pen = penalty.unsqueeze(-1)  # [N, 1]
    penalised = torch.where(logits > 0, logits / pen, logits * pen)  # [N, V]
    return torch.where(seen, penalised, logits)  # [N, V]


def _draw_unfiltered(scaled: Tensor, seeds: Tensor, offsets: Tensor) -> Tensor:
    """Gumbel-max over the whole vocabulary. scaled: [N, V] -> [N] int64."""
    vocab = scaled.shape[-1]
    token_ids = torch.arange(vocab, dtype=torch.int64, device=scaled.device)  # [V]
    noise = _gumbel_noise(seeds, offsets, token_ids)  # [N, V]
    return noise.add_(scaled).argmax(dim=-1)  # [N]


def _draw_filtered(
    scaled: Tensor, top_k: Tensor, top_p: Tensor, seeds: Tensor, offsets: Tensor
) -> Tensor:
    """Top-k then top-p, then Gumbel-max, all in descending-sorted order. -> [N] int64.

    Noise is keyed by the sorted token ids, so a row that keeps every token draws exactly what
    `_draw_unfiltered` would.
    """
    vocab = scaled.shape[-1]
    # Stable so that equal logits keep ascending id order, matching argmax's lowest-id tie rule.
    sorted_vals, sorted_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)  # [N, V]
    rank = torch.arange(vocab, device=scaled.device)  # [V]

    k_eff = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)  # [N]
    keep = rank < k_eff.unsqueeze(-1)  # [N, V]
    kept_vals = sorted_vals.masked_fill(~keep, -math.inf)  # [N, V]

    probs = torch.softmax(kept_vals, dim=-1)  # [N, V]
    mass_before = torch.cumsum(probs, dim=-1).sub_(probs)  # [N, V] exclusive prefix sum
    # A token stays if the tokens ranked above it do not yet reach top_p. Rank 0 always stays,
    # and top_p >= 1 keeps everything even where float rounding pushes the prefix past 1.
    in_nucleus = (mass_before < top_p.unsqueeze(-1)) | (top_p >= 1.0).unsqueeze(-1)
    keep &= in_nucleus
    keep[:, 0] = True
    final_vals = sorted_vals.masked_fill(~keep, -math.inf)  # [N, V]

    noise = _gumbel_noise(seeds, offsets, sorted_ids)  # [N, V]
    choice = noise.add_(final_vals).argmax(dim=-1, keepdim=True)  # [N, 1] sorted position
    return sorted_ids.gather(-1, choice).squeeze(-1)  # [N]


def _argmax_logsumexp(raw: Tensor) -> tuple[Tensor, Tensor]:
    """Row argmax and logsumexp of raw [N, V] -> ([N] int64, [N] float32).

    On CPU one native kernel reads each row twice while it sits in cache (torch's logsumexp
    alone makes five passes and an [N, V] temporary). Rows with a NaN or an infinity are left to
    torch, whose semantics for them are the reference.
    """
    module = native.load() if raw.device.type == "cpu" and raw.shape[-1] > 0 else None
    if module is not None:
        ids, lse, finite = module.argmax_logsumexp(raw)
        if bool(finite.all()):
            return ids, lse
    return raw.argmax(dim=-1), torch.logsumexp(raw, dim=-1)


def sample(logits: Tensor, params: SamplingTensors) -> SampleOutput:
    """Pick one token per row. logits: [N, V] float32, unmodified model output."""
    raw = logits.float()  # [N, V]; no-op for float32
    n, vocab = raw.shape
    x = raw

    if params.penalty_mask is not None:
        x = _apply_repetition_penalty(x, params.repetition_penalty, params.penalty_mask)

    greedy_rows = params.temperature <= 0  # [N]
    if params.token_mask is not None:
        # A row that allows nothing would otherwise be all -inf and yield an arbitrary id; it
        # falls back to the argmax of its penalised logits instead (the engine rejects such
        # requests earlier, this only keeps the kernel well defined).
        any_allowed = params.token_mask.any(dim=-1)  # [N]
        disallowed = ~params.token_mask & any_allowed.unsqueeze(-1)  # [N, V]
        x = x.masked_fill(disallowed, -math.inf)
        greedy_rows = greedy_rows | ~any_allowed

    raw_ids, lse = _argmax_logsumexp(raw)  # [N], [N]
    greedy_ids = raw_ids if x is raw else x.argmax(dim=-1)  # [N]
    if params.all_greedy:
        token_ids = greedy_ids
    else:
        # Greedy rows run through the sampler too (batch stays vectorised), with T = 1 to keep
        # their values finite; their draws are then discarded by the where below.
        temp = torch.where(greedy_rows, 1.0, params.temperature)  # [N]
        scaled = x / temp.unsqueeze(-1)  # [N, V]
        if params.needs_top_k_top_p:
            sampled_ids = _draw_filtered(
                scaled, params.top_k, params.top_p, params.seeds, params.offsets
            )
        else:
            sampled_ids = _draw_unfiltered(scaled, params.seeds, params.offsets)
        token_ids = torch.where(greedy_rows, greedy_ids, sampled_ids)  # [N]

    # Log-probs via logsumexp rather than a materialised [N, V] log_softmax.
    chosen = raw.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1) - lse  # [N]
    k = min(params.num_logprobs, vocab)
    if k > 0:
        top_vals, top_ids = torch.topk(raw, k, dim=-1)  # [N, k], descending
        top_logprobs = top_vals - lse.unsqueeze(-1)  # [N, k]
    else:
        top_ids = torch.empty(n, 0, dtype=torch.int64, device=raw.device)
        top_logprobs = torch.empty(n, 0, dtype=torch.float32, device=raw.device)
    return SampleOutput(
        token_ids=token_ids,
        logprobs=chosen,
        top_ids=top_ids,
        top_logprobs=top_logprobs,
    )
