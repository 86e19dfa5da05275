"""Linear layers with weights pre-packed for oneDNN (CPU only).

``F.linear`` on CPU re-lays the weight into the GEMM kernel's blocked format on every call; for
the small-to-medium M of a serving step that reorder costs about as much as the multiply. Packing
once at load time (``torch.ops.mkldnn._reorder_linear_weight``) and calling the pre-packed GEMM
(``torch.ops.mkldnn._linear_pointwise``) roughly doubles float32 throughput and helps bfloat16 too.
The arithmetic is the same oneDNN GEMM, so results agree with ``F.linear`` to float32 rounding.
Where oneDNN packs float32 but not bfloat16 (an AVX2 CPU), bfloat16 weights are packed widened
to float32 (``pack_dtype``).

The native GEMM (``csrc/gemm.cpp``, ``gemm_kernel``) runs instead wherever it is built. On a CPU
with AVX2 but not AVX-512, float32 (and widened bfloat16) weights: on the development machine it
runs a decode step's M = 64 at 99-109 GFLOP/s where oneDNN's AVX2 kernels run 83-95, and is level
with them at M = 512. On a CPU with AVX-512, bfloat16 weights: with AVX512_BF16 (a Zen 4) it runs
M = 64 at 410-415 GFLOP/s against oneDNN's 342-346 and M = 16 at 353 against 229, and is level from
M = 256 on; without it (an Ice Lake), its FMAs emulating vdpbf16ps, 269-273 against oneDNN's 58-64
from M = 64 to 1024. On a CPU with AVX-512, float32 weights, in the same panels and tiles with FMAs:
211 against oneDNN's 200 GFLOP/s at M = 64, 1.4% behind at M = 1024. On those two (the AVX-512 GEMM)
a SwiGLU's gate/up weight (``GATE_UP_NAME``) is packed paired, so its GEMM applies the activation as
it stores (``fused_gate_up_silu``): W1 bfloat16 ran 1-4% faster end to end than with oneDNN from 256
rows on and a separate SwiGLU, on one packed copy instead of two; W1 float32 about 1% and the
decode-heavy ``w1-long`` about 4% (docs/cpu-kernels.md). ``FERRUM_CPU_GEMM`` picks the kernel:
``auto`` (the default, as above), ``native`` (the same where it is built) or ``onednn``. It is read
once, when the first weight is packed, and the choice is logged once (event ``cpu_gemm``).

``prepack_linears(module)`` swaps every ``nn.Linear`` under ``module`` for a ``PackedLinear`` that
shares the same ``weight``/``bias`` Parameters (so ``state_dict``/``named_parameters`` and
weight export are unchanged) and keeps a packed copy beside them; a tied LM head
(``layers.TiedLinear``) gets a packed copy of the embedding table. It is the CPU backend's
``prepare_model`` step, and idempotent. A weight modified in place after packing (its version
counter moved) is re-packed on the next call, so packing early is never wrong, only wasted.

A serving model does not need the plain copy beside the packed one: ``release_plain_weights``
frees it (the engine's runner does, on CPU), halving the memory of every packed linear and of
every packed mixture-of-experts layer (``moe.ExpertWeights``, packed by ``cpu_moe``). The
module then runs only its packed GEMMs: it cannot be trained, moved, cast or exported any more
(each of those raises a clear error rather than computing with an empty weight).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ferrum_kernels import native
from ferrum_kernels.layers import TiedLinear
from ferrum_kernels.moe import ExpertWeights

__all__ = [
    "GEMM_KERNELS",
    "PackedLinear",
    "fused_gate_up_silu",
    "gemm_kernel",
    "greedy_linear",
    "mkldnn_linear_available",
    "pack_dtype",
    "packed_bytes",
    "packed_linear",
    "prepack_linears",
    "release_plain_weights",
]

# M the packed layout is tuned for: a typical unified step (a prefill chunk plus decodes).
DEFAULT_BATCH_HINT = 256
_SUPPORTED = (torch.float32, torch.bfloat16)
_available: dict[torch.dtype, bool] = {}
# FERRUM_CPU_GEMM's values (see the module docstring).
GEMM_KERNELS = ("auto", "native", "onednn")
# The models' name for a dense SwiGLU MLP's gate/up projection (prepack_linears pairs it).
GATE_UP_NAME = "gate_up_proj"
# Decided once: the kernel ("native" or "onednn") of each dtype's packed linears.
_native_gemm: dict[torch.dtype, str] | None = None
_LOG = logging.getLogger(__name__)


def mkldnn_linear_available(dtype: torch.dtype = torch.float32) -> bool:
    """True when this torch build has oneDNN and its pre-packed linear ops run `dtype` on this
    CPU (checked once per dtype). oneDNN's bfloat16 packing needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT and refuses on an AVX2-only CPU, where bfloat16 linears stay on F.linear."""
    if dtype not in _available:
        try:
            w = torch.ones(8, 8, dtype=dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
            x = torch.ones(1, 8, dtype=dtype)
            out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            ok = bool(torch.backends.mkldnn.is_available()) and float(out[0, 0]) == 8.0
        except (AttributeError, RuntimeError):
            ok = False
        _available[dtype] = ok
    return _available[dtype]


def pack_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a `dtype` weight is packed and multiplied in on this CPU, or None where it is
    not packed. Itself where oneDNN packs it. bfloat16 where oneDNN packs only float32 (an AVX2
    CPU): float32, the weight widened once at packing, each call's input widened and its output
    rounded back to bfloat16. The products of bfloat16 values are exact in float32, so the
    results are a bfloat16 GEMM's with float32 accumulation, as F.linear's, to summation order;
    unpacked bfloat16 GEMMs there run several times slower than float32 ones. The price is
    memory: such a linear's packed copy takes float32's bytes."""
    if dtype not in _SUPPORTED:
        return None
    if mkldnn_linear_available(dtype):
        return dtype
    if dtype == torch.bfloat16 and mkldnn_linear_available(torch.float32):
        return torch.float32
    return None


def _gemm_kernels() -> dict[torch.dtype, str]:
    global _native_gemm
    if _native_gemm is None:
        choice = os.environ.get("FERRUM_CPU_GEMM", "auto").strip().lower() or "auto"
        if choice not in GEMM_KERNELS:
            allowed = ", ".join(GEMM_KERNELS)
            raise ValueError(f"FERRUM_CPU_GEMM must be one of {allowed}, got {choice!r}")
        module = None if choice == "onednn" else native.load()
        kernels = {torch.float32: "onednn", torch.bfloat16: "onednn"}
        if module is not None:
            if module.gemm_isa()[0]:
                kernels[torch.float32] = "native"
            if module.gemm_bf16_available():
                kernels[torch.bfloat16] = "native"
        _native_gemm = kernels
        # One line for operators: which GEMM float32 (and widened bfloat16) and bfloat16
        # linears run, and whether the native bfloat16 one emulates vdpbf16ps (an AVX-512 CPU
        # without AVX512_BF16).
        emulated = (
            module is not None
            and kernels[torch.bfloat16] == "native"
            and bool(module.gemm_bf16_emulated())
        )
        _LOG.info(
            "cpu_gemm",
            extra={
                "float32_kernel": kernels[torch.float32],
                "bfloat16_kernel": kernels[torch.bfloat16],
                "bfloat16_emulated": emulated,
                "setting": choice,
            },
        )
    return _native_gemm


def _native_gemm_built(compute_dtype: torch.dtype) -> bool:
    module = native.load()
    if module is None:
        return False
    if compute_dtype == torch.bfloat16:
        return bool(module.gemm_bf16_available())
    return compute_dtype == torch.float32 and bool(module.gemm_isa()[0])


def _native_gemm_pairs(compute_dtype: torch.dtype) -> bool:
    """Whether the native GEMM of `compute_dtype` is the AVX-512 one, which packs a gate/up
    weight paired and fuses its SwiGLU (and folds an LM head's greedy choice: ``greedy``):
    bfloat16 always (it needs AVX-512), float32 on an AVX-512 CPU (the AVX2 kernel does
    not)."""
    module = native.load()
    if module is None:
        return False
    return compute_dtype == torch.bfloat16 or (
        compute_dtype == torch.float32 and bool(module.gemm_isa()[1])
    )


def gemm_kernel(compute_dtype: torch.dtype) -> str:
    """Which GEMM a weight packed to multiply in `compute_dtype` runs: "native" (float32 on a
    CPU with AVX2 and FMA, bfloat16 on one with AVX-512F) or "onednn", unless
    FERRUM_CPU_GEMM says otherwise."""
    return _gemm_kernels().get(compute_dtype, "onednn")


class PackedWeight:
    """A weight (and optional bias) with its packed copy for ``kernel`` (oneDNN or the native
    GEMM), re-packed when it changes."""

    __slots__ = (
        "_batch_hint",
        "_packed",
        "_version",
        "bias",
        "compute_dtype",
        "dtype",
        "in_features",
        "kernel",
        "out_features",
        "paired",
        "released",
        "weight",
    )

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        batch_hint: int = DEFAULT_BATCH_HINT,
        kernel: str | None = None,  # "native" or "onednn"; None: gemm_kernel's choice
        gate_up: bool = False,  # rows: a SwiGLU's gate, then its up (see ``swiglu``)
    ) -> None:
        self.weight = weight  # [N, K]
        self.bias = bias  # [N] or None
        self.dtype = weight.dtype  # what callers pass and get back
        self.compute_dtype = pack_dtype(weight.dtype) or weight.dtype  # what the GEMM multiplies
        if kernel is None:
            kernel = gemm_kernel(self.compute_dtype)
        elif kernel not in ("native", "onednn"):
            raise ValueError(f"kernel must be 'native' or 'onednn', got {kernel!r}")
        elif kernel != "onednn" and not _native_gemm_built(self.compute_dtype):
            raise ValueError(f"the native GEMM is not built here for {self.compute_dtype}")
        self.kernel = kernel  # what the copies are packed for
        # A gate/up weight's native copy in the paired layout (each panel holds the same 16
        # columns of both halves), so its GEMM can apply the SwiGLU as it stores: the AVX-512
        # GEMM's (bfloat16, or float32 on an AVX-512 CPU).
        self.paired = (
            gate_up
            and kernel == "native"
            and _native_gemm_pairs(self.compute_dtype)
            and weight.shape[0] % 2 == 0
        )
        # Kept: the plain weight may be freed.
        self.out_features, self.in_features = weight.shape
        self._batch_hint = batch_hint
        self._packed: torch.Tensor | None = None
        self._version = -1
        # The plain weight's storage was freed (release_plain): the packed copy is all there is.
        self.released = False

    def packed(self) -> torch.Tensor:
        """The packed copy."""
        if self.released:
            assert self._packed is not None  # packed before the plain copy was freed
            return self._packed
        version = self.weight._version
        if self._packed is None or version != self._version:
            with torch.no_grad():
                plain = self.weight.detach().to(self.compute_dtype)
                if self.kernel == "native":
                    self._packed = self._pack_native(plain)
                else:
                    self._packed = torch.ops.mkldnn._reorder_linear_weight(plain, self._batch_hint)
            self._version = version
        return self._packed

    def _pack_native(self, plain: torch.Tensor) -> torch.Tensor:
        module = native.load()
        if self.paired:
            return module.pack_gemm_weight_halves(plain)  # type: ignore[no-any-return]
        return module.pack_gemm_weight(plain)  # type: ignore[no-any-return]

    def packed_tensors(self) -> list[torch.Tensor]:
        """Every packed copy made so far (for counting their bytes)."""
        return [] if self._packed is None else [self._packed]

    def release_plain(self) -> int:
        """Pack (if not yet), then free the plain weight's storage; returns the bytes freed.
        The Parameter stays (empty), so the module's structure and names are unchanged."""
        if self.released:
            return 0
        self.packed()
        weight = self.weight
        freed = weight.numel() * weight.element_size()
        with torch.no_grad():
            weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
        self.released = True
        return freed

    def widens(self, x: torch.Tensor) -> bool:
        """Whether ``widened(x)`` runs: a plain (not paired) bfloat16 weight on the native GEMM
        and x in bfloat16."""
        return (
            self.kernel == "native"
            and not self.paired
            and self.compute_dtype == torch.bfloat16
            and x.dtype == torch.bfloat16
        )

    def widened(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] float32 holding ``self(x).float()`` exactly (each output rounded
        to bfloat16, then widened), written by the GEMM in one pass: a float32 copy of a
        vocabulary-wide output costs more than the GEMM's wider stores. Only where
        ``widens(x)``."""
        if not self.widens(x):
            raise ValueError("widened needs a plain bfloat16 weight on the native GEMM")
        return self._native(x, "widened")

    def folds_greedy(self, x: torch.Tensor) -> bool:
        """Whether ``greedy(x)`` runs: a plain (not paired) weight with K > 0 on the AVX-512
        native GEMM (bfloat16, or float32 on an AVX-512 CPU) and x [N, K] in its dtype."""
        return (
            self.kernel == "native"
            and not self.paired
            and self.in_features > 0
            and x.dim() == 2
            and x.dtype == self.compute_dtype
            and _native_gemm_pairs(self.compute_dtype)
        )

    def greedy(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """x [N, K] -> (argmax [N] int64, its log-probability [N] float32) of the float32 logits
        this weight gives x (``widened(x)`` in bfloat16, ``self(x)`` in float32), folded by the
        GEMM as it stores them: the [N, V] logits are never written. The argmax is theirs
        exactly; the log-probability agrees with ``sampling.sample``'s to float32 rounding.
        None where a row's logits hold a NaN or an infinity: the caller then samples the
        logits, whose semantics define such rows. Only where ``folds_greedy(x)``."""
        if not self.folds_greedy(x):
            raise ValueError("greedy needs a plain weight on the AVX-512 native GEMM, x [N, K]")
        bias = None if self.bias is None else self.bias.detach().to(self.compute_dtype)
        module = native.load()
        ids, logprobs, finite = module.packed_gemm_greedy(
            x.contiguous(), self.packed(), bias, self.out_features
        )
        return (ids, logprobs) if bool(finite.all()) else None

    def _native(
        self, x: torch.Tensor, store: Literal["plain", "swiglu", "widened"], start: int = 0
    ) -> torch.Tensor:
        # Called about fifty times a decode step: the reshapes and casts run only when they
        # change something (each is a dispatcher call even as a no-op). "widened" keeps the
        # GEMM's float32 output; the others return x's dtype. start > 0 (a plain pack, on a
        # panel boundary: `trails`): the output columns from start on, from their panels alone.
        compute = self.compute_dtype
        bias = None if self.bias is None else self.bias.detach().to(compute)
        flat_input = x.dim() == 2
        rows = x if flat_input else x.reshape(-1, x.shape[-1])
        if rows.dtype != compute:
            rows = rows.to(compute)
        packed = self.packed()
        module = native.load()
        n = self.out_features - start
        if start:
            first = start // int(packed.shape[2])
            packed = packed.narrow(0, first, packed.shape[0] - first)  # whole panels: contiguous
            bias = None if bias is None else bias[start:]
        if self.paired:
            flat: torch.Tensor = module.packed_gemm_halves(rows, packed, bias, n, store == "swiglu")
        elif store == "widened":
            flat = module.packed_gemm_widened(rows, packed, bias, n)
        else:
            flat = module.packed_gemm(rows, packed, bias, n)
        out = flat if flat_input else flat.view(*x.shape[:-1], flat.shape[-1])
        return out if store == "widened" or out.dtype == x.dtype else out.to(x.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        if self.kernel == "native":
            return self._native(x, "plain")
        compute = self.compute_dtype
        bias = None if self.bias is None else self.bias.detach().to(compute)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x.contiguous().to(compute), self.packed(), bias, "none", [], ""
        )
        return out.to(x.dtype)

    def trails(self, x: torch.Tensor, start: int) -> bool:
        """Whether ``trailing(x, start)`` runs: a plain (not paired) weight on the native GEMM,
        x in its dtype, and ``start`` on a panel boundary short of N (panels hold 32 columns
        on the AVX-512 GEMM, 16 on the AVX2 one)."""
        if self.kernel != "native" or self.paired or x.dtype != self.compute_dtype:
            return False
        width = int(self.packed().shape[2])
        return 0 < start < self.out_features and start % width == 0

    def trailing(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """x [..., K] -> ``self(x)[..., start:]`` bit for bit, from the panels holding those
        columns alone: the packed copy's later panels are a weight of their own (a fused qkv
        projection's k and v, when no row needs its q). Only where ``trails(x, start)``."""
        if not self.trails(x, start):
            raise ValueError("trailing needs a plain native pack, x in its dtype, a panel start")
        return self._native(x, "plain", start)

    def fuses_swiglu(self, x: torch.Tensor) -> bool:
        """Whether ``swiglu(x)`` runs fused: a paired gate/up weight (on the AVX-512 native GEMM:
        bfloat16 or float32, with AVX-512F) and x in its dtype."""
        return self.paired and x.dtype == self.compute_dtype

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> silu(gate) * up [..., N/2], the SwiGLU applied by the GEMM as it stores
        its output: no [..., N] intermediate is written. Bit-identical to ``silu_and_mul`` of
        ``self(x)`` (in bfloat16 each half rounded first). Only where ``fuses_swiglu(x)``."""
        if not self.fuses_swiglu(x):
            raise ValueError("swiglu needs a paired gate/up weight on the AVX-512 native GEMM")
        return self._native(x, "swiglu")


def _packable(weight: torch.Tensor) -> bool:
    on_cpu = weight.device.type == "cpu" and weight.dim() == 2
    return on_cpu and pack_dtype(weight.dtype) is not None


def packed_linear(weight: torch.Tensor) -> PackedWeight | None:
    """A packed view of a bare [N, K] weight (e.g. a tied LM head), or None if not packable."""
    return PackedWeight(weight, None) if _packable(weight) else None


class PackedLinear(nn.Linear):
    """``nn.Linear`` whose inference forward runs a pre-packed GEMM (``gemm_kernel``)."""

    _pack: PackedWeight | None

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, batch_hint: int = DEFAULT_BATCH_HINT, gate_up: bool = False
    ) -> PackedLinear:
        # Built on the meta device so nothing is allocated, then handed the original Parameters.
        module = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        module.weight = linear.weight
        module.bias = linear.bias
        module._pack = PackedWeight(linear.weight, linear.bias, batch_hint, gate_up=gate_up)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pack = getattr(self, "_pack", None)
        if pack is not None and pack.released:
            # Only the packed copy exists: it serves CPU inference and nothing else.
            if x.device.type != "cpu" or x.dtype != pack.dtype:
                raise RuntimeError(
                    f"this linear keeps only its packed {pack.dtype} weight "
                    f"(release_plain_weights); it cannot run {x.dtype} on {x.device.type}"
                )
            out_packed: torch.Tensor = pack(x)
            return out_packed
        # Autograd does not flow through the packed op: fall back when a gradient is wanted.
        if pack is None or (torch.is_grad_enabled() and self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)
        if not _packable(self.weight):  # moved to another device or dtype after packing
            return F.linear(x, self.weight, self.bias)
        out: torch.Tensor = pack(x)
        return out


def fused_gate_up_silu(proj: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of ``proj(x)`` [T, I] in one GEMM (``PackedWeight.swiglu``) when proj is
    a packed gate/up projection whose native GEMM serves x; else None, and the caller applies
    the activation to ``proj(x)`` itself."""
    pack = _serving_pack(proj, x)
    return pack.swiglu(x) if pack is not None and pack.fuses_swiglu(x) else None


def trailing_columns(proj: nn.Module, x: torch.Tensor, start: int) -> torch.Tensor | None:
    """``proj(x)[..., start:]`` computed from those columns' weights alone
    (``PackedWeight.trailing``) when proj is a packed linear whose native GEMM serves x and
    ``start`` falls on a panel boundary; else None, and the caller slices ``proj(x)``."""
    pack = _serving_pack(proj, x)
    return pack.trailing(x, start) if pack is not None and pack.trails(x, start) else None


def float32_linear(head: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """``head(x).float()`` [..., N] in one GEMM (``PackedWeight.widened``) when head is a packed
    linear or a packed tied head whose native GEMM widens x; else None, and the caller widens
    ``head(x)`` itself. For LM heads: their logits are sampled in float32."""
    pack = _head_pack(head, x)
    return pack.widened(x) if pack is not None and pack.widens(x) else None


def greedy_linear(head: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's argmax token of ``head(x).float()`` and its log-probability, folded by the
    head's GEMM (``PackedWeight.greedy``) when head is a packed linear or a packed tied head
    whose native GEMM folds them for x; else None, and the caller samples the logits (as it
    does where a row's logits hold a NaN or an infinity)."""
    pack = _head_pack(head, x)
    return pack.greedy(x) if pack is not None and pack.folds_greedy(x) else None


def _head_pack(head: nn.Module, x: torch.Tensor) -> PackedWeight | None:
    """The packed copy an LM head's forward would run for x: a tied head's (on a CPU input) or
    a packed linear's (``_serving_pack``); else None."""
    if isinstance(head, TiedLinear):
        tied = head.packed
        return tied if isinstance(tied, PackedWeight) and x.device.type == "cpu" else None
    return _serving_pack(head, x)


def _serving_pack(proj: nn.Module, x: torch.Tensor) -> PackedWeight | None:
    """The packed copy ``proj``'s forward would run for x: a ``PackedLinear``'s pack, on a CPU
    input, unless the forward falls back to F.linear (a gradient wanted, or the plain weight
    moved to another device or dtype since packing); else None."""
    if not isinstance(proj, PackedLinear) or proj._pack is None or x.device.type != "cpu":
        return None
    pack = proj._pack
    if not pack.released and (
        (torch.is_grad_enabled() and proj.weight.requires_grad) or not _packable(proj.weight)
    ):
        return None
    return pack


def prepack_linears(module: nn.Module, batch_hint: int = DEFAULT_BATCH_HINT) -> int:
    """Replace every packable ``nn.Linear`` below ``module`` in place and pack every tied head
    (``TiedLinear``) not packed yet; return how many weights were packed (0 when run again).
    A linear named ``GATE_UP_NAME`` is a SwiGLU's gate/up projection (rows: gate, then up), as
    the models name it: its native copy is paired for ``fused_gate_up_silu``."""
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and _packable(child.weight):
                gate_up = name == GATE_UP_NAME
                setattr(parent, name, PackedLinear.from_linear(child, batch_hint, gate_up))
                count += 1
            elif isinstance(child, TiedLinear) and child.packed is None:
                child.packed = packed_linear(child.weight)
                count += int(child.packed is not None)
    return count


def packed_bytes(module: nn.Module) -> int:
    """Bytes of the packed copies below ``module`` made so far: linears, tied heads and
    experts. Parameter counts miss them; a served model holds them instead of (or, for a tied
    head, beside) its plain weights, at the packed dtype (float32 for widened bfloat16)."""
    packs: list[PackedWeight] = []
    for child in module.modules():
        if isinstance(child, PackedLinear) and child._pack is not None:
            packs.append(child._pack)
        elif isinstance(child, TiedLinear) and isinstance(child.packed, PackedWeight):
            packs.append(child.packed)
        elif isinstance(child, ExpertWeights):
            packs += [w for pair in child.packed or () for w in pair if isinstance(w, PackedWeight)]
    made = (t for pack in packs for t in pack.packed_tensors())
    return sum(p.numel() * p.element_size() for p in made)


def release_plain_weights(module: nn.Module, after_each: Callable[[], object] | None = None) -> int:
    """Free the plain weight of every packed linear and the plain expert tensors of every
    packed ``ExpertWeights`` below ``module`` (see the module docstring); returns the bytes
    freed. For a serving model only: after it the model runs CPU inference in its dtype and
    nothing else. Tied heads keep theirs (the table is also the embedding); experts oneDNN did
    not pack (or whose packs are stale) keep theirs, as the reference runs on them.

    ``after_each()`` runs after each weight (or expert stack) is freed. Start-up hands the freed
    pages back to the kernel there: an allocator that keeps what it frees would otherwise hold
    the plain copies while the packed ones made meanwhile (not always in their place) add up."""
    freed = 0
    for child in module.modules():
        released = 0
        if isinstance(child, PackedLinear) and child._pack is not None:
            released = child._pack.release_plain()
        elif isinstance(child, ExpertWeights):
            released = _release_experts(child)
        if released and after_each is not None:
            after_each()
        freed += released
    return freed


def _release_experts(experts: ExpertWeights) -> int:
    if experts.released or not experts.is_packed():
        return 0
    packs = [w for pair in experts.packed or () for w in pair if isinstance(w, PackedWeight)]
    if len(packs) != 2 * experts.num_experts:
        return 0  # another backend's copies: not ours to vouch for
    # Each pack holds a view of the stacked storage: freeing those views first is what lets the
    # storage go (and re-packs any expert changed in place since, so none runs stale).
    for pack in packs:
        pack.release_plain()
    freed = 0
    with torch.no_grad():
        for param in (experts.gate_up_proj, experts.down_proj):
            freed += param.numel() * param.element_size()
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    experts.released = True
    return freed
