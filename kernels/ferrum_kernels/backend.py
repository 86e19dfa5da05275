"""Kernel selection: one object holding the attention (with its KV write), norm, rotary, SwiGLU,
mixture-of-experts and sampling implementations a model runs with, chosen once per device.

Backends:

* ``torch``: the reference implementations (``attention``, ``layers``, ``sampling``), any device.
  The numerics oracle for everything else.
* ``cpu``: the CPU fast path. Attention is ``cpu_attention.CpuAttention`` (a per-forward plan
  and a grow-only workspace, native decode/prefill kernels where they build); norm + residual,
  rotary and SwiGLU are the fused native ``cpu_fused`` kernels, which fall back to the
  reference per call for inputs they do not serve; ``prepare_model`` pre-packs every linear
  (the LM head included, tied or not) and every MoE expert for oneDNN (``cpu_linear``,
  ``cpu_moe``), and ``fused_moe`` runs the grouped expert GEMMs on the packed experts.
* ``triton``: the Triton kernels (CUDA; CPU tensors only under ``TRITON_INTERPRET=1``), with the
  torch SwiGLU, the fused-MoE grouped GEMM (``triton_moe``), plus a graph-safe decode attention
  for CUDA graphs.

``select_backend(device)`` returns the CPU backend on CPU, the Triton one on CUDA when ``triton``
imports, and the torch reference otherwise. ``prefer="torch"``, ``"cpu"`` or ``"triton"`` forces
a choice (``"cpu"`` and ``"triton"`` raise if they cannot be honoured rather than silently
running something else). The choice is the caller's alone: nothing here reads the environment
(the CLI maps ``FERRUM_KERNEL_BACKEND`` onto ``--kernel-backend``, so a flag can override it).

Every implementation has the torch reference's semantics, so the model code calls the same
functions whatever was selected:

    attention(query [T,H,D], key [T,Hkv,D], value [T,Hkv,D], kv_layer, meta, scale,
              window=0, softcap=0.0) -> [T,H,D]
        writes this step's key/value into kv_layer [2,NB,BS,Hkv,D] at meta.slot_mapping, then
        attends every item's query rows over its paged history (its new tokens included), so
        the model never writes K/V itself; a backend may keep per-forward state keyed on the
        identity of ``meta``, which every layer of a forward shares. ``window`` is the layer's
        sliding window (0 = global): a query at position p sees keys in (p - window, p]
    write_kv(kv_layer, key, value, slot_mapping [T]) -> None (in place): the write alone, the
        one ``attention`` starts with (the CUDA-graph decode path pairs it with
        ``decode_attention``)
    rms_norm_residual(x, residual | None, weight, eps) -> (normed, new_residual = x + residual)
        (the CPU version updates ``residual`` in place)
    rotary(q [T,H,D], k [T,Hkv,D], cos [T,D/2], sin [T,D/2]) -> (q, k)
        (the Triton and CPU versions rotate in place and return their inputs; the torch one
        returns new tensors; callers must use the returned tensors and not rely on either)
    silu_and_mul(gate_up [T,2I]) -> silu(gate) * up [T,I]
    gate_up_silu(gate_up_proj, x [T,H]) -> silu(gate) * up [T,I] of gate_up_proj(x) (a method:
        ``fused_gate_up_silu``'s one GEMM where it applies, else ``silu_and_mul`` of the
        projection)
    float32_logits(head, x [N,H]) -> head(x).float() [N,V] (a method: ``float32_linear``'s one
        GEMM where it applies, else the head's output widened)
    greedy_logits(head, x [N,H]) -> (argmax [N] int64, its log-probability [N] float32) of
        float32_logits(head, x), or None (a method: ``greedy_linear``'s GEMM folding them as it
        stores, where it applies; None elsewhere, and the caller samples the logits)
    output_columns(proj, x [T,K], start) -> proj(x)[:, start:] (a method: ``trailing_columns``'
        GEMM over those columns' weights where it applies, a bare ``nn.Linear`` over its
        weight's rows from ``start``, else the whole projection sliced)
    fused_moe(x [T,H], experts: ExpertWeights, weights [T,K] float32, ids [T,K] int64) -> [T,H]
        sum over k of weights[:, k] * SwiGLU expert ids[:, k] applied to x, in x's dtype: the
        experts of a sparse layer as grouped GEMMs over the tokens sorted by expert
        (``moe.fused_moe_reference``; the router's softmax/top-k is ``moe.route``, shared)
    sample(logits [N,V] float32, SamplingTensors) -> SampleOutput

plus, optionally:

* ``decode_attention(DecodeBatch, num_heads, num_kv_heads)``: a factory for a CUDA-graph-safe
  decode-only attention (see ``DecodeBatch``). Only the Triton backend has one: the torch
  reference (``attention.reference_decode_attention``) gathers every row's whole table width,
  which is fine in tests but far too slow and large for production graphs, so the others leave
  it None and the engine then runs decode steps eagerly.
* ``prepare_model(model) -> int``: puts a model's weights in the form the backend wants (the CPU
  backend pre-packs its linears); idempotent, returns how many weights it changed. The model
  runs it when the backend is bound (``LlamaForCausalLM.bind_backend``).
* ``decode_layer(DenseLayerParts) -> DecodeLayerFn | None``: a dense decoder layer's whole
  decode-only step in one function, computing what the functions above compute for it (the
  CPU backend's ``cpu_decode_layer.NativeDecodeLayer``: its native kernels without the Python
  between them). The model asks for one per dense layer once its weights are prepared; a
  function that answers None for a step leaves it to the generic path.
* ``decode_layers(layers' DecodeLayerFns) -> DecodeLayersFn | None``: every layer of a
  decode-only step in one function, for a model whose layers all have a ``decode_layer`` (the
  CPU backend's ``cpu_decode_layer.NativeDecodeLayers``: the layers' kernels in one native
  call, bit for bit the layers' own results). A function that answers None for a step leaves
  the layers to run one by one.
* ``prefill_layers(layers' DecodeLayerFns) -> PrefillLayersFn | None``: the same for every
  layer but the last of a step of prompt chunks alone (``NativeDecodeLayers.prefill``, with the
  prefill attention); the model's last layer then finishes only the output rows.

Third-party attention (FlashInfer, flash-attn) plugs in through ``register_attention_provider``:
a factory that, given the device, returns an attention callable with the signature above (KV
write included: both libraries have their own paged append) or None when it cannot serve that
device. Nothing is registered by default: FlashInfer's paged API needs a per-step ``plan`` over
host-side index arrays and a workspace buffer, and flash-attn 2's paged path needs a pool block
size that is a multiple of 256 (the engine defaults to 16); neither could be verified on a GPU
here, so they are left as documented hooks rather than untested adapters. The pool layout
``[2, NB, BS, Hkv, D]`` gives both libraries what they expect for an "NHD" paged cache:
``kv_layer[0]`` and ``kv_layer[1]`` are ``[NB, BS, Hkv, D]`` views.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ferrum_kernels.attention import (
    AttentionMetadata,
    DecodeAttentionFn,
    DecodeBatch,
    paged_attention,
    write_kv,
)
from ferrum_kernels.cpu_attention import CpuAttention, write_kv_cpu
from ferrum_kernels.cpu_decode_layer import (
    DenseLayerParts,
    LayersFn,
    NativeDecodeLayer,
    NativeDecodeLayers,
)
from ferrum_kernels.cpu_fused import rms_norm_residual_cpu, rotary_cpu, silu_and_mul_cpu
from ferrum_kernels.cpu_linear import (
    float32_linear,
    fused_gate_up_silu,
    greedy_linear,
    prepack_linears,
    trailing_columns,
)
from ferrum_kernels.cpu_moe import fused_moe_cpu, prepack_experts
from ferrum_kernels.layers import apply_rotary, rms_norm, silu_and_mul
from ferrum_kernels.moe import ExpertWeights, fused_moe_reference
from ferrum_kernels.sampling import SampleOutput, SamplingTensors, sample

__all__ = [
    "AttentionFn",
    "DecodeAttentionFactory",
    "DecodeLayerFactory",
    "DecodeLayerFn",
    "DecodeLayersFactory",
    "DecodeLayersFn",
    "DenseLayerParts",
    "FusedMoeFn",
    "KernelBackend",
    "ModelPreparer",
    "PagedAttentionFn",
    "PrefillLayersFactory",
    "PrefillLayersFn",
    "RmsNormResidualFn",
    "RotaryFn",
    "SampleFn",
    "SiluAndMulFn",
    "WriteKvFn",
    "WriteThenAttend",
    "cpu_backend",
    "register_attention_provider",
    "select_backend",
    "torch_backend",
    "triton_available",
]


class AttentionFn(Protocol):
    """(query, key, value, kv_layer, meta, scale, window=0, softcap=0.0) -> output; writes
    key/value into kv_layer first. window: the layer's sliding window, 0 = global; softcap: its
    attention logit soft-cap, 0 = none."""

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor: ...


class PagedAttentionFn(Protocol):
    """(query, kv_layer, meta, scale, window=0, softcap=0.0) -> output, over a pool that already
    holds this step's K/V."""

    def __call__(
        self,
        query: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor: ...


WriteKvFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
RmsNormResidualFn = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
]
RotaryFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
]
SiluAndMulFn = Callable[[torch.Tensor], torch.Tensor]
# (gate_up_proj, x) -> silu(gate) * up, or None where the fused form does not apply.
FusedGateUpSiluFn = Callable[[nn.Module, torch.Tensor], torch.Tensor | None]
Float32LinearFn = Callable[[nn.Module, torch.Tensor], torch.Tensor | None]
GreedyLinearFn = Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]
TrailingColumnsFn = Callable[[nn.Module, torch.Tensor, int], torch.Tensor | None]
FusedMoeFn = Callable[[torch.Tensor, ExpertWeights, torch.Tensor, torch.Tensor], torch.Tensor]
SampleFn = Callable[[torch.Tensor, SamplingTensors], SampleOutput]
ModelPreparer = Callable[[nn.Module], int]
# A dense layer's decode-only step in one function: (hidden, residual, cos, sin, kv_layer,
# meta) -> (output, residual), or None where it does not serve the step (the generic path
# then runs it).
DecodeLayerFn = Callable[
    [
        torch.Tensor,
        torch.Tensor | None,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        AttentionMetadata,
    ],
    tuple[torch.Tensor, torch.Tensor] | None,
]
# The backend's DecodeLayerFn for a dense layer made of `DenseLayerParts`, or None.
DecodeLayerFactory = Callable[[DenseLayerParts], DecodeLayerFn | None]
# Every layer of a decode-only step in one function: (embeddings, cos, sin, kv_cache [L, ...],
# meta) -> (last output, residual), or None where it does not serve the step.
DecodeLayersFn = LayersFn
# The backend's DecodeLayersFn over a model's layers' DecodeLayerFns (None for a layer without
# one), or None.
DecodeLayersFactory = Callable[[Sequence[DecodeLayerFn | None]], DecodeLayersFn | None]
# Every layer but the last of a step of prompt chunks alone in one function: (embeddings, cos,
# sin, kv_cache [L, ...], meta) -> (the next-to-last layer's output, residual), or None where it
# does not serve the step. The model's last layer finishes the output rows alone.
PrefillLayersFn = LayersFn
# The backend's PrefillLayersFn over a model's layers' DecodeLayerFns, or None.
PrefillLayersFactory = Callable[[Sequence[DecodeLayerFn | None]], PrefillLayersFn | None]
AttentionProvider = Callable[[torch.device], AttentionFn | None]
# (batch, num_heads, num_kv_heads) -> graph-safe attend(query, kv_layer, scale); called outside
# graph capture (it may allocate and copy), the returned callable is what gets captured.
DecodeAttentionFactory = Callable[[DecodeBatch, int, int], DecodeAttentionFn]


@dataclass(frozen=True, slots=True)
class KernelBackend:
    """The kernels a model runs with (see the module docstring for the contracts)."""

    name: str  # "torch", "cpu", "triton", or "<base>+<attention provider>"
    attention: AttentionFn
    write_kv: WriteKvFn
    rms_norm_residual: RmsNormResidualFn
    rotary: RotaryFn
    silu_and_mul: SiluAndMulFn
    sample: SampleFn
    decode_attention: DecodeAttentionFactory | None = None
    prepare_model: ModelPreparer | None = None
    fused_moe: FusedMoeFn = fused_moe_reference
    # The projection and its SwiGLU in one kernel, or None where it does not apply.
    fused_gate_up_silu: FusedGateUpSiluFn | None = None
    # A linear whose output is widened to float32 as the GEMM stores it, or None where not.
    float32_linear: Float32LinearFn | None = None
    # An LM head's greedy choice and its log-probability per row, folded by its GEMM without
    # writing the logits, or None where not.
    greedy_linear: GreedyLinearFn | None = None
    # A linear's last output columns from their weights alone, or None where it cannot.
    trailing_columns: TrailingColumnsFn | None = None
    # A dense layer's decode-only step in one function, or None where there is none.
    decode_layer: DecodeLayerFactory | None = None
    # Every layer's decode-only step in one function, or None where there is none.
    decode_layers: DecodeLayersFactory | None = None
    # Every layer but the last of a prompt-only step in one function, or None where none.
    prefill_layers: PrefillLayersFactory | None = None

    def gate_up_silu(self, gate_up_proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up [T, I] of gate_up_proj(x) [T, 2I] (rows: gate, then up)."""
        if self.fused_gate_up_silu is not None:
            fused = self.fused_gate_up_silu(gate_up_proj, x)
            if fused is not None:
                return fused
        return self.silu_and_mul(gate_up_proj(x))

    def float32_logits(self, head: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``head(x).float()``: an LM head's logits [N, V] in float32, in one kernel where the
        backend's ``float32_linear`` serves the head."""
        if self.float32_linear is not None:
            widened = self.float32_linear(head, x)
            if widened is not None:
                return widened
        logits: torch.Tensor = head(x)
        return logits.float()

    def greedy_logits(
        self, head: nn.Module, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each row's argmax token of ``float32_logits(head, x)`` [N] int64 and its
        log-probability [N] float32 (what ``sample`` gives a plain greedy row), where the
        backend's ``greedy_linear`` folds them from the head's GEMM; else None, and the caller
        samples the logits."""
        return None if self.greedy_linear is None else self.greedy_linear(head, x)

    def output_columns(self, proj: nn.Module, x: torch.Tensor, start: int) -> torch.Tensor:
        """``proj(x)[:, start:]`` [T, N - start], computing the other columns only where no
        kernel can skip them: a fused qkv projection's k and v when no row needs its q."""
        if self.trailing_columns is not None:
            tail = self.trailing_columns(proj, x, start)
            if tail is not None:
                return tail
        if type(proj) is nn.Linear:
            bias = None if proj.bias is None else proj.bias[start:]
            return F.linear(x, proj.weight[start:], bias)
        out: torch.Tensor = proj(x)
        return out[:, start:]


@dataclass(frozen=True, slots=True)
class WriteThenAttend:
    """An ``AttentionFn`` made of a KV write and a paged attention over the pool it wrote."""

    write_kv: WriteKvFn
    paged_attention: PagedAttentionFn

    def __call__(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_layer: torch.Tensor,  # [2, NB, BS, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        # Written before attending so each new token sees its own K/V.
        self.write_kv(kv_layer, key, value, meta.slot_mapping)
        return self.paged_attention(query, kv_layer, meta, scale, window, softcap)


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
        attention=WriteThenAttend(write_kv, paged_attention),
        write_kv=write_kv,
        rms_norm_residual=_rms_norm_residual_torch,
        rotary=_rotary_torch,
        silu_and_mul=silu_and_mul,
        sample=sample,
    )


# ----------------------------------------------------------------------------------------------
# CPU fast path
# ----------------------------------------------------------------------------------------------


def _prepare_cpu_model(model: nn.Module) -> int:
    return prepack_linears(model) + prepack_experts(model)


def cpu_backend() -> KernelBackend:
    """The CPU fast path. Each call has its own attention workspace and plan: one per model.

    Usable whatever the machine: the native kernels are compiled on first use and every fused
    function falls back to the reference for what it cannot serve (no compiler,
    ``FERRUM_CPU_NATIVE=0``, another dtype), as do the packed linears without oneDNN.
    """
    attention = CpuAttention()
    return KernelBackend(
        name="cpu",
        attention=attention,
        write_kv=write_kv_cpu,
        rms_norm_residual=rms_norm_residual_cpu,
        rotary=rotary_cpu,
        silu_and_mul=silu_and_mul_cpu,
        sample=sample,
        prepare_model=_prepare_cpu_model,
        fused_moe=fused_moe_cpu,
        fused_gate_up_silu=fused_gate_up_silu,
        float32_linear=float32_linear,
        greedy_linear=greedy_linear,
        trailing_columns=trailing_columns,
        decode_layer=functools.partial(NativeDecodeLayer.build, attention=attention),
        decode_layers=NativeDecodeLayers.build,
        prefill_layers=NativeDecodeLayers.build_prefill,
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
    from ferrum_kernels.triton_moe import fused_moe_triton
    from ferrum_kernels.triton_norm import rms_norm_residual_triton, rotary_triton
    from ferrum_kernels.triton_sampling import sample_triton

    return KernelBackend(
        name="triton",
        attention=WriteThenAttend(triton_write_kv, paged_attention_triton),
        write_kv=triton_write_kv,
        rms_norm_residual=rms_norm_residual_triton,
        rotary=rotary_triton,
        silu_and_mul=silu_and_mul,
        sample=sample_triton,
        decode_attention=prepare_decode_triton,
        fused_moe=fused_moe_triton,
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
    ``select_backend`` then raises, since the caller asked for it explicitly. The other kernels
    (the bare ``write_kv`` included) come from Triton when usable, else from torch.
    """
    if name in ("auto", "torch", "cpu", "triton"):
        raise ValueError(f"{name!r} is a built-in backend name")
    _PROVIDERS[name] = factory


# ----------------------------------------------------------------------------------------------
# Selection
# ----------------------------------------------------------------------------------------------


def select_backend(device: torch.device | str, prefer: str = "auto") -> KernelBackend:
    """Pick the kernels for ``device``.

    prefer: "auto" (the CPU fast path on CPU, Triton on CUDA when it imports, else torch),
    "torch", "cpu" (raises off CPU), "triton" (raises if triton is missing or the device is not
    CUDA, unless TRITON_INTERPRET=1), or the name of a registered attention provider. The
    environment is not consulted: the caller (the CLI) has already resolved its flags.
    """
    device = torch.device(device)
    if prefer == "torch":
        return torch_backend()
    if prefer == "cpu":
        if device.type != "cpu":
            raise RuntimeError(f"CPU kernels requested for {device}")
        return cpu_backend()
    if prefer == "triton":
        if not _triton_usable(device):
            raise RuntimeError(
                f"Triton kernels requested for {device} but "
                + ("triton is not installed" if not triton_available() else "it is not CUDA")
            )
        return _triton_backend()
    if prefer == "auto":
        if device.type == "cpu":
            return cpu_backend()
        return (
            _triton_backend() if device.type == "cuda" and triton_available() else torch_backend()
        )
    factory = _PROVIDERS.get(prefer)
    if factory is None:
        known = ["auto", "torch", "cpu", "triton", *sorted(_PROVIDERS)]
        raise ValueError(f"unknown kernel backend {prefer!r}; expected one of {known}")
    attention = factory(device)
    if attention is None:
        raise RuntimeError(f"attention provider {prefer!r} cannot serve {device}")
    base = _triton_backend() if _triton_usable(device) else torch_backend()
    # decode_layer off: the provider's attention serves every layer and step.
    return replace(
        base,
        name=f"{base.name}+{prefer}",
        attention=attention,
        decode_layer=None,
        decode_layers=None,
        prefill_layers=None,
    )
