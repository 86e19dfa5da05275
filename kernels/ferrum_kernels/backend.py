"""Kernel selection: one object holding the attention / KV-write / norm / rotary / sampling
implementations a model runs with, chosen once per device.

``select_backend(device)`` returns the Triton kernels on CUDA when ``triton`` imports and the
torch reference otherwise (always on CPU). ``prefer="torch"`` or ``"triton"`` forces a choice
(``"triton"`` raises if it cannot be honoured rather than silently running something else).
With ``prefer="auto"`` the ``FERRUM_KERNEL_BACKEND`` environment variable may force it too,
which is handy for A/B runs without code changes.

Every implementation has the torch reference's semantics, so the model code calls the same
five functions whatever was selected:

    attention(query [T,H,D], kv_layer, meta, scale) -> [T,H,D]
    write_kv(kv_layer, key [T,Hkv,D], value [T,Hkv,D], slot_mapping [T]) -> None (in place)
    rms_norm_residual(x, residual | None, weight, eps) -> (normed, new_residual = x + residual)
    rotary(q [T,H,D], k [T,Hkv,D], cos [T,D/2], sin [T,D/2]) -> (q, k)
        (the Triton version rotates in place and returns its inputs; the torch one returns new
        tensors; callers must use the returned tensors and not rely on either behaviour)
    sample(logits [N,V] float32, SamplingTensors) -> SampleOutput

plus, optionally, ``decode_attention(DecodeBatch, num_heads, num_kv_heads)``: a factory for a
CUDA-graph-safe decode-only attention (see ``DecodeBatch``). Only the Triton backend has one:
the torch reference (``attention.reference_decode_attention``) gathers every row's whole table
width, which is fine in tests but far too slow and large for production graphs, so the torch
backend leaves it None and the engine then runs decode steps eagerly.

Third-party attention (FlashInfer, flash-attn) plugs in through ``register_attention_provider``:
a factory that, given the device, returns an attention callable with the signature above (or
None when it cannot serve that device). Nothing is registered by default: FlashInfer's paged API
needs a per-step ``plan`` over host-side index arrays and a workspace buffer, and flash-attn 2's
paged path needs a pool block size that is a multiple of 256 (the engine defaults to 16); neither
could be verified on a GPU here, so they are left as documented hooks rather than untested
adapters. The pool layout ``[2, NB, BS, Hkv, D]`` gives both libraries what they expect for an
"NHD" paged cache: ``kv_layer[0]`` and ``kv_layer[1]`` are ``[NB, BS, Hkv, D]`` views.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ferrum_kernels.attention import (
    AttentionMetadata,
    DecodeAttentionFn,
    DecodeBatch,
    paged_attention,
    write_kv,
)
from ferrum_kernels.layers import apply_rotary, rms_norm
from ferrum_kernels.sampling import SampleOutput, SamplingTensors, sample

__all__ = [
    "AttentionFn",
    "DecodeAttentionFactory",
    "KernelBackend",
    "register_attention_provider",
    "select_backend",
    "torch_backend",
    "triton_available",
]

AttentionFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]
WriteKvFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
RmsNormResidualFn = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
]
RotaryFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
]
SampleFn = Callable[[torch.Tensor, SamplingTensors], SampleOutput]
AttentionProvider = Callable[[torch.device], AttentionFn | None]
# (batch, num_heads, num_kv_heads) -> graph-safe attend(query, kv_layer, scale); called outside
# graph capture (it may allocate and copy), the returned callable is what gets captured.
DecodeAttentionFactory = Callable[[DecodeBatch, int, int], DecodeAttentionFn]

_ENV = "FERRUM_KERNEL_BACKEND"


@dataclass(frozen=True, slots=True)
class KernelBackend:
    """The kernels a model runs with (see the module docstring for the contracts)."""

    name: str  # "torch", "triton", or "<base>+<attention provider>"
    attention: AttentionFn
    write_kv: WriteKvFn
    rms_norm_residual: RmsNormResidualFn
    rotary: RotaryFn
    sample: SampleFn
    decode_attention: DecodeAttentionFactory | None = None


# ----------------------------------------------------------------------------------------------
# Torch reference
# ----------------------------------------------------------------------------------------------


def _rms_norm_residual_torch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = x if residual is None else residual + x  # [.., N]
    return rms_norm(hidden, weight, eps), hidden


def _rotary_torch(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def torch_backend() -> KernelBackend:
    """The reference implementations (CPU and CUDA)."""
    return KernelBackend(
        name="torch",
        attention=paged_attention,
        write_kv=write_kv,
        rms_norm_residual=_rms_norm_residual_torch,
        rotary=_rotary_torch,
        sample=sample,
    )


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------


def triton_available() -> bool:
    """True when the ``triton`` package is installed (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


def _triton_backend() -> KernelBackend:
    # Imported lazily: CPU-only installs never need triton.
    from ferrum_kernels.triton_attention import (
        paged_attention_triton,
        prepare_decode_triton,
        triton_write_kv,
    )
    from ferrum_kernels.triton_norm import rms_norm_residual_triton, rotary_triton
    from ferrum_kernels.triton_sampling import sample_triton

    return KernelBackend(
        name="triton",
        attention=paged_attention_triton,
        write_kv=triton_write_kv,
        rms_norm_residual=rms_norm_residual_triton,
        rotary=rotary_triton,
        sample=sample_triton,
        decode_attention=prepare_decode_triton,
    )


def _triton_usable(device: torch.device) -> bool:
    if not triton_available():
        return False
    if device.type == "cuda":
        return True
    # CPU tensors only run under the interpreter (tests); never chosen automatically.
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------------------------
# Attention providers (FlashInfer / flash-attn hook)
# ----------------------------------------------------------------------------------------------

_PROVIDERS: dict[str, AttentionProvider] = {}


def register_attention_provider(name: str, factory: AttentionProvider) -> None:
    """Make ``select_backend(device, prefer=name)`` use ``factory(device)`` for attention.

    The factory returns None when it cannot serve the device (e.g. the library is missing);
    ``select_backend`` then raises, since the caller asked for it explicitly. The other four
    kernels come from Triton when usable, else from torch.
    """
    if name in ("auto", "torch", "triton"):
        raise ValueError(f"{name!r} is a built-in backend name")
    _PROVIDERS[name] = factory


# ----------------------------------------------------------------------------------------------
# Selection
# ----------------------------------------------------------------------------------------------


def select_backend(device: torch.device | str, prefer: str = "auto") -> KernelBackend:
    """Pick the kernels for ``device``.

    prefer: "auto" (Triton on CUDA when it imports, else torch; ``$FERRUM_KERNEL_BACKEND``
    overrides), "torch", "triton" (raises if triton is missing or the device is not CUDA, unless
    TRITON_INTERPRET=1), or the name of a registered attention provider.
    """
    device = torch.device(device)
    if prefer == "auto":
        prefer = os.environ.get(_ENV, "auto") or "auto"
    if prefer == "torch":
        return torch_backend()
    if prefer == "triton":
        if not _triton_usable(device):
            raise RuntimeError(
                f"Triton kernels requested for {device} but "
                + ("triton is not installed" if not triton_available() else "it is not CUDA")
            )
        return _triton_backend()
    if prefer == "auto":
        return (
            _triton_backend() if device.type == "cuda" and triton_available() else torch_backend()
        )
    factory = _PROVIDERS.get(prefer)
    if factory is None:
        known = ["auto", "torch", "triton", *sorted(_PROVIDERS)]
        raise ValueError(f"unknown kernel backend {prefer!r}; expected one of {known}")
    attention = factory(device)
    if attention is None:
        raise RuntimeError(f"attention provider {prefer!r} cannot serve {device}")
    base = _triton_backend() if _triton_usable(device) else torch_backend()
    return replace(base, name=f"{base.name}+{prefer}", attention=attention)
