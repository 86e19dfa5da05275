# mypy: disable-error-code="import-untyped,untyped-decorator,no-untyped-def"
# (@triton.jit kernels take untyped pointer/scalar arguments by design; triton ships no stubs.
# The Python wrappers below are fully annotated.)
"""Fused next-token sampling as Triton kernels, matching ``ferrum_kernels.sampling.sample``.

One program per row streams the vocabulary once and, in that single pass, applies the
repetition penalty and the token mask, tracks the greedy argmax (plus the unmasked argmax that
rows allowing nothing fall back to), the log-sum-exp of the raw logits (for the chosen token's
log-prob) and, for sampled rows without top-k/top-p, the Gumbel-max draw. The Gumbel noise is the
same counter-based splitmix64 stream as ``sampling._gumbel_noise`` computed in uint64 on the fly:
the integer bits and the uniforms are identical, and on CUDA the two logs use libdevice's
``logf`` (the CUDA math-library routine torch's own log kernel runs), so draws match the torch
path. Under the CPU interpreter the log is numpy's, which may differ in the last ulp (a draw can
then only flip on a near-exact tie). Divisions use ``div_rn`` (IEEE), like torch.

Top-k/top-p: the descending *stable* sort stays in torch (a pure-Triton nucleus needs a full
sort or a radix select; torch's segmented sort is already bandwidth-bound for [N, V] rows), and a
second Triton kernel fuses everything after it: top-k cut, softmax, exclusive prefix sum, nucleus
cut, noise keyed by the sorted token ids and argmax. That replaces about ten [N, V] torch passes
(softmax, cumsum, masks, the noise's ~15 integer ops, add, argmax, gather) by one read of the
sorted rows; a row with top_k > 0 only scans its first top_k entries.

Ties: equal values keep the lowest token id, like ``torch.argmax`` and the stable sort. NaN
logits are not supported (torch would pick the NaN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ferrum_kernels.sampling import SampleOutput, SamplingTensors

__all__ = ["gumbel_noise_triton", "sample_triton"]

_BLOCK_V = 2048


@triton.jit
def _mix64(z):
    """splitmix64 finaliser on uint64 (wrapping multiply, logical shifts)."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _row_key(seed, offset):
    """sampling._row_keys for one row; seed/offset are int64 scalars."""
    s = seed.to(tl.uint64, bitcast=True)
    o = offset.to(tl.uint64, bitcast=True)
    key = _mix64(s + 0x9E3779B97F4A7C15)
    return _mix64(key ^ (o * 0xD1B54A32D192ED03))


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    # On CUDA, libdevice's logf is the same CUDA math-library routine torch's log kernel uses,
    # so the float noise is bit-identical too; the interpreter has no libdevice (numpy log).
    if LIBDEVICE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _gumbel(key, token_ids, LIBDEVICE: tl.constexpr):
    """Gumbel(0, 1) noise of int64 token ids [BLOCK] for a row key -> float32 [BLOCK]."""
    bits = _mix64(key + token_ids.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15)
    bits = bits >> 41  # keep the top 23 bits: (v + 0.5) * 2**-23 is exact and inside (0, 1)
    u = (bits.to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
    return -_log(-_log(u, LIBDEVICE), LIBDEVICE)


@triton.jit
def _argmax_update(best_val, best_idx, vals, base):
    """Fold a chunk into a running (max, lowest index of max); strict > keeps earlier ids."""
    c_val, c_idx = tl.max(vals, 0, return_indices=True, return_indices_tie_break_left=True)
    take = c_val > best_val
    return tl.where(take, c_val, best_val), tl.where(take, base + c_idx, best_idx)


@triton.jit
def _sample_pass_kernel(
    logits_ptr,  # [N, V] float32 raw logits
    seen_ptr,  # [N, V] uint8 repetition-penalty mask (HAS_PENALTY)
    allow_ptr,  # [N, V] uint8 token mask, 1 = allowed (HAS_MASK)
    penalty_ptr,  # [N] float32
    temperature_ptr,  # [N] float32
    seeds_ptr,  # [N] int64
    offsets_ptr,  # [N] int64
    ids_ptr,  # [N] int64 out: chosen (or greedy, when FILTERED) token
    lse_ptr,  # [N] float32 out: logsumexp of the raw row
    greedy_ptr,  # [N] int8 out: row is decided by argmax (T <= 0 or nothing allowed)
    scaled_ptr,  # [N, V] float32 out: penalised, masked, temperature-scaled logits (FILTERED)
    stride_l,
    stride_seen,
    stride_allow,
    stride_scaled,
    vocab,
    HAS_PENALTY: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SAMPLE: tl.constexpr,  # Gumbel-max over the full vocabulary in this pass
    FILTERED: tl.constexpr,  # write `scaled` for the sort + filtered draw instead
    BLOCK_V: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    temp = tl.load(temperature_ptr + row)
    t_eff = tl.where(temp <= 0.0, 1.0, temp)  # greedy rows stay finite, as in the reference
    if HAS_PENALTY:
        pen = tl.load(penalty_ptr + row)
    if SAMPLE:
        key = _row_key(tl.load(seeds_ptr + row), tl.load(offsets_ptr + row))

    neg_inf = float("-inf")
    lse_max = tl.full([], neg_inf, tl.float32)
    lse_sum = tl.zeros([], tl.float32)
    best_val = tl.full([], neg_inf, tl.float32)  # argmax of penalised + masked
    best_idx = tl.zeros([], tl.int64)
    free_val = tl.full([], neg_inf, tl.float32)  # argmax ignoring the token mask
    free_idx = tl.zeros([], tl.int64)
    any_allowed = tl.zeros([], tl.int32)
    draw_val = tl.full([], neg_inf, tl.float32)
    draw_idx = tl.zeros([], tl.int64)

    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)  # [BV]
        ok = cols < vocab
        raw = tl.load(logits_ptr + row * stride_l + cols, mask=ok, other=neg_inf)  # [BV]
        # Online logsumexp of the raw logits (log-probs are always reported unpenalised).
        c_max = tl.maximum(lse_max, tl.max(raw, 0))
        c_safe = tl.where(c_max == neg_inf, 0.0, c_max)
        lse_sum = lse_sum * tl.exp(lse_max - c_safe) + tl.sum(tl.exp(raw - c_safe), 0)
        lse_max = c_max

        x = raw
        if HAS_PENALTY:
            seen = tl.load(seen_ptr + row * stride_seen + cols, mask=ok, other=0) != 0
            # div_rn: IEEE division like torch (Triton's fp32 `/` may be approximate on GPU).
            x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, pen), x * pen), x)
        if HAS_MASK:
            allowed = tl.load(allow_ptr + row * stride_allow + cols, mask=ok, other=0) != 0
            any_allowed = tl.maximum(any_allowed, tl.max(allowed.to(tl.int32), 0))
            free_val, free_idx = _argmax_update(free_val, free_idx, x, start)
            x = tl.where(allowed, x, neg_inf)
        best_val, best_idx = _argmax_update(best_val, best_idx, x, start)
        if SAMPLE:
            noisy = tl.math.div_rn(x, t_eff) + _gumbel(key, cols.to(tl.int64), LIBDEVICE)
            draw_val, draw_idx = _argmax_update(
                draw_val, draw_idx, tl.where(ok, noisy, neg_inf), start
            )
        if FILTERED:
            tl.store(scaled_ptr + row * stride_scaled + cols, tl.math.div_rn(x, t_eff), mask=ok)

    greedy = temp <= 0.0
    if HAS_MASK:
        # A row allowing nothing falls back to its unmasked argmax (reference semantics).
        nothing = any_allowed == 0
        best_idx = tl.where(nothing, free_idx, best_idx)
        greedy = greedy | nothing
    chosen = best_idx
    if SAMPLE:
        chosen = tl.where(greedy, best_idx, draw_idx)
    tl.store(ids_ptr + row, chosen)
    tl.store(lse_ptr + row, lse_max + tl.log(lse_sum))
    tl.store(greedy_ptr + row, greedy.to(tl.int8))


@triton.jit
def _filtered_draw_kernel(
    vals_ptr,  # [N, V] float32, each row sorted descending (stable)
    ids_ptr,  # [N, V] int64 token id of each sorted entry
    top_k_ptr,  # [N] int64
    top_p_ptr,  # [N] float32
    seeds_ptr,  # [N] int64
    offsets_ptr,  # [N] int64
    out_ptr,  # [N] int64 sampled token
    stride_v,
    stride_i,
    vocab,
    BLOCK_V: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    neg_inf = float("-inf")
    top_k = tl.load(top_k_ptr + row)
    k_eff = tl.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    top_p = tl.load(top_p_ptr + row)
    # top_p >= 1 keeps everything even where float rounding pushes the prefix mass past 1.
    p_cut = tl.where(top_p >= 1.0, float("inf"), top_p)
    key = _row_key(tl.load(seeds_ptr + row), tl.load(offsets_ptr + row))
    top = tl.load(vals_ptr + row * stride_v)  # rank 0 is the row max
    top_safe = tl.where(top == neg_inf, 0.0, top)

    # Pass 1: softmax denominator over the top-k survivors.
    denom = tl.zeros([], tl.float32)
    for start in range(0, k_eff, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)  # [BV]
        v = tl.load(vals_ptr + row * stride_v + cols, mask=cols < k_eff, other=neg_inf)
        denom += tl.sum(tl.exp(v - top_safe), 0)

    # A row whose every entry is -inf (all tokens masked) is decided greedily by the caller;
    # keep its arithmetic NaN-free anyway.
    denom = tl.where(denom == 0.0, 1.0, denom)

    # Pass 2: nucleus cut on the exclusive prefix mass, then Gumbel-max in sorted order.
    carry = tl.zeros([], tl.float32)
    best_val = tl.full([], neg_inf, tl.float32)
    best_pos = tl.zeros([], tl.int64)
    for start in range(0, k_eff, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)  # [BV]
        in_k = cols < k_eff
        v = tl.load(vals_ptr + row * stride_v + cols, mask=in_k, other=neg_inf)
        probs = tl.where(in_k, tl.exp(v - top_safe) / denom, 0.0)  # [BV]
        # Same formula as the reference: inclusive prefix sum minus self.
        before = tl.cumsum(probs, 0) + carry - probs
        keep = in_k & (before < p_cut)
        keep = keep | (cols == 0)  # the top token always survives
        ids = tl.load(ids_ptr + row * stride_i + cols, mask=in_k, other=0)
        noisy = tl.where(keep, v + _gumbel(key, ids, LIBDEVICE), neg_inf)
        best_val, best_pos = _argmax_update(best_val, best_pos, noisy, start)
        carry += tl.sum(probs, 0)
    tl.store(out_ptr + row, tl.load(ids_ptr + row * stride_i + best_pos))


@triton.jit
def _noise_kernel(
    seeds_ptr, offsets_ptr, out_ptr, vocab, stride_o, BLOCK_V: tl.constexpr, LIBDEVICE: tl.constexpr
):  # out: [N, V] float32
    row = tl.program_id(0).to(tl.int64)
    key = _row_key(tl.load(seeds_ptr + row), tl.load(offsets_ptr + row))
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        tl.store(
            out_ptr + row * stride_o + cols,
            _gumbel(key, cols.to(tl.int64), LIBDEVICE),
            mask=cols < vocab,
        )


def gumbel_noise_triton(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """The in-kernel noise for token ids 0..V-1 as a tensor [N, V] (for tests and debugging)."""
    n = seeds.shape[0]
    out = torch.empty((n, vocab), dtype=torch.float32, device=seeds.device)
    if n:
        _noise_kernel[(n,)](
            seeds, offsets, out, vocab, out.stride(0), BLOCK_V=_BLOCK_V, LIBDEVICE=_libdevice(out)
        )
    return out


def _libdevice(t: torch.Tensor) -> bool:
    """NVIDIA libdevice is available when compiling for CUDA (not under the interpreter, and not
    on ROCm builds of torch, whose libdevice has different entry points)."""
    return t.device.type == "cuda" and torch.version.hip is None


def _u8(mask: torch.Tensor) -> torch.Tensor:
    """bool [N, V] -> uint8 view (no copy): Triton loads bytes, not i1."""
    mask = mask if mask.stride(-1) == 1 else mask.contiguous()
    return mask.view(torch.uint8)


def sample_triton(logits: torch.Tensor, params: SamplingTensors) -> SampleOutput:
    """Drop-in for ``sampling.sample``. logits: [N, V] float32, unmodified model output."""
    raw = logits.float()  # [N, V]
    if raw.stride(-1) != 1:
        raw = raw.contiguous()
    n, vocab = raw.shape
    device = raw.device
    token_ids = torch.empty(n, dtype=torch.int64, device=device)
    lse = torch.empty(n, dtype=torch.float32, device=device)
    greedy = torch.empty(n, dtype=torch.int8, device=device)
    filtered = not params.all_greedy and params.needs_top_k_top_p
    sample_here = not params.all_greedy and not filtered
    scaled = torch.empty((n, vocab), dtype=torch.float32, device=device) if filtered else raw
    seen = _u8(params.penalty_mask) if params.penalty_mask is not None else raw
    allow = _u8(params.token_mask) if params.token_mask is not None else raw
    if n:
        _sample_pass_kernel[(n,)](
            raw,
            seen,
            allow,
            params.repetition_penalty,
            params.temperature,
            params.seeds,
            params.offsets,
            token_ids,
            lse,
            greedy,
            scaled,
            raw.stride(0),
            seen.stride(0),
            allow.stride(0),
            scaled.stride(0),
            vocab,
            HAS_PENALTY=params.penalty_mask is not None,
            HAS_MASK=params.token_mask is not None,
            SAMPLE=sample_here,
            FILTERED=filtered,
            BLOCK_V=_BLOCK_V,
            LIBDEVICE=_libdevice(raw),
            num_warps=8,
        )
    if filtered and n:
        # Stable so equal values keep ascending ids, matching the reference's tie rule.
        sorted_vals, sorted_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
        drawn = torch.empty(n, dtype=torch.int64, device=device)
        _filtered_draw_kernel[(n,)](
            sorted_vals,
            sorted_ids,
            params.top_k,
            params.top_p,
            params.seeds,
            params.offsets,
            drawn,
            sorted_vals.stride(0),
            sorted_ids.stride(0),
            vocab,
            BLOCK_V=_BLOCK_V,
            LIBDEVICE=_libdevice(raw),
            num_warps=8,
        )
        token_ids = torch.where(greedy.bool(), token_ids, drawn)

    chosen = raw.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1) - lse  # [N]
    k = min(params.num_logprobs, vocab)
    if k > 0:
        top_vals, top_ids = torch.topk(raw, k, dim=-1)  # [N, k], descending
        top_logprobs = top_vals - lse.unsqueeze(-1)
    else:
        top_ids = torch.empty(n, 0, dtype=torch.int64, device=device)
        top_logprobs = torch.empty(n, 0, dtype=torch.float32, device=device)
    return SampleOutput(
        token_ids=token_ids, logprobs=chosen, top_ids=top_ids, top_logprobs=top_logprobs
    )
