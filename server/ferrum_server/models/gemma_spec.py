"""Gemma 2 / Gemma 3 (text) hyper-parameters beyond the Llama family's, read from ``config.json``
exactly as transformers (5.x, and the 4.x field layout) reads them.

What is supported: ``query_pre_attn_scalar``; attention logit soft-capping (Gemma 2 only:
transformers' Gemma 3 attention never caps, so its ``attn_logit_softcapping`` is ignored here
too) and final logit soft-capping; ``layer_types`` (or the pattern: every other layer slides on
Gemma 2, ``sliding_window_pattern`` (6) on Gemma 3); RoPE with no scaling or ``linear``
scaling, one base for every layer on Gemma 2, ``rope_local_base_freq`` for Gemma 3's sliding
layers and ``rope_theta`` (+ scaling) for its global ones. Anything else (another activation,
another RoPE scaling type, bidirectional attention) is refused with a one-line ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
SLIDING, FULL = "sliding_attention", "full_attention"
GELU_TANH = "gelu_pytorch_tanh"

# transformers' defaults when config.json omits a field (Gemma2Config, Gemma3TextConfig).
_DEFAULT_SCALAR = 256.0
_DEFAULT_THETA = {"gemma2": 10_000.0, "gemma3_text": 1_000_000.0}
_DEFAULT_LOCAL_THETA = 10_000.0  # Gemma 3's rope_local_base_freq
_DEFAULT_ATTN_CAP = {"gemma2": 50.0, "gemma3_text": None}
_DEFAULT_FINAL_CAP = {"gemma2": 30.0, "gemma3_text": None}
_DEFAULT_WINDOW = 4096
# A layer i slides unless (i + 1) is a multiple of the pattern.
_DEFAULT_PATTERN = {"gemma2": 2, "gemma3_text": 6}


@dataclass(frozen=True, slots=True)
class GemmaSpec:
    """What a Gemma model needs beyond ``ModelConfig``'s Llama-family fields. The global
    layers' RoPE base is ``ModelConfig.rope_theta``; the effective per-layer windows are
    ``ModelConfig.sliding_windows``."""

    query_pre_attn_scalar: float  # attention scale = query_pre_attn_scalar ** -0.5
    attn_logit_softcap: float  # 0 = none
    final_logit_softcap: float  # 0 = none
    sliding_window: int | None  # as configured (kept for to_hf even when it hides nothing)
    sliding_layers: tuple[bool, ...]  # per layer: layer_types says "sliding_attention"
    rope_local_theta: float  # the sliding layers' RoPE base
    rope_local_factor: float = 1.0  # linear RoPE scaling of the sliding layers
    rope_global_factor: float = 1.0  # linear RoPE scaling of the global layers

    def __post_init__(self) -> None:
        if self.query_pre_attn_scalar <= 0:
            raise ValueError(f"query_pre_attn_scalar must be > 0, got {self.query_pre_attn_scalar}")
        for name in ("attn_logit_softcap", "final_logit_softcap"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = none), got {getattr(self, name)}")
        for name in ("rope_local_theta", "rope_local_factor", "rope_global_factor"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def attention_scale(self) -> float:
        return float(self.query_pre_attn_scalar**-0.5)

    @classmethod
    def from_hf(
        cls, d: Mapping[str, Any], model_type: str, num_layers: int
    ) -> tuple[float, GemmaSpec]:
        """-> (the global layers' RoPE base, the spec) from a Gemma ``config.json`` dict."""
        if d.get("text_config") is not None or d.get("vision_config") is not None:
            raise ValueError(
                "multimodal Gemma 3 configs (text_config/vision_config) are not supported: "
                "only Gemma3ForCausalLM with a text config"
            )
        if d.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=true is not supported (causal only)")
        activation = d.get("hidden_activation") or GELU_TANH
        if activation != GELU_TANH:
            raise ValueError(
                f"unsupported hidden_activation {activation!r} for Gemma: only {GELU_TANH!r}"
            )
        theta, global_factor, local_theta, local_factor = _parse_rope(d, model_type)
        attn_cap = _cap(d, "attn_logit_softcapping", _DEFAULT_ATTN_CAP[model_type])
        spec = cls(
            query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", _DEFAULT_SCALAR)),
            # transformers' Gemma 3 attention passes no soft-cap, whatever the config says.
            attn_logit_softcap=attn_cap if model_type == "gemma2" else 0.0,
            final_logit_softcap=_cap(d, "final_logit_softcapping", _DEFAULT_FINAL_CAP[model_type]),
            sliding_window=_window(d),
            sliding_layers=_sliding_layers(d, model_type, num_layers),
            rope_local_theta=local_theta,
            rope_local_factor=local_factor,
            rope_global_factor=global_factor,
        )
        return theta, spec

    def to_hf(self, model_type: str, rope_theta: float) -> dict[str, Any]:
        """The Gemma fields of a ``config.json`` (4.x key names, which 5.x converts)."""
        d: dict[str, Any] = {
            "hidden_activation": GELU_TANH,
            # transformers' strict config classes type it int (256, 144, 168 on the Hub).
            "query_pre_attn_scalar": _int_if_whole(self.query_pre_attn_scalar),
            "attn_logit_softcapping": self.attn_logit_softcap or None,
            "final_logit_softcapping": self.final_logit_softcap or None,
            "sliding_window": self.sliding_window,
            "layer_types": [SLIDING if s else FULL for s in self.sliding_layers],
            "use_bidirectional_attention": False,
            "rope_theta": rope_theta,
            "rope_scaling": _linear_to_hf(self.rope_global_factor),
        }
        if model_type == "gemma2":
            if (self.rope_local_theta, self.rope_local_factor) != (
                rope_theta,
                self.rope_global_factor,
            ):
                raise ValueError("Gemma 2 has one RoPE for every layer")
        else:
            if self.rope_local_factor != 1.0:
                raise ValueError("Gemma 3 config.json has no RoPE scaling for sliding layers")
            d["rope_local_base_freq"] = self.rope_local_theta
        return d


def _int_if_whole(x: float) -> int | float:
    return int(x) if x.is_integer() else x


def _window(d: Mapping[str, Any]) -> int | None:
    raw = d.get("sliding_window", _DEFAULT_WINDOW)
    return None if raw is None else int(raw)


def _cap(d: Mapping[str, Any], key: str, default: float | None) -> float:
    value = d.get(key, default)
    if value is None:
        return 0.0
    if float(value) <= 0:
        raise ValueError(f"{key} must be > 0 or null, got {value!r}")
    return float(value)


def _check_full_rotary(d: Mapping[str, Any]) -> None:
    factor = d.get("partial_rotary_factor", 1.0)
    if factor not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={factor} is not supported (only 1.0)")


def _linear_factor(params: Mapping[str, Any] | None) -> float:
    """The ``linear`` factor of a rope scaling dict (1.0 for none); refuses other types."""
    if not params:
        return 1.0
    _check_full_rotary(params)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return 1.0
    if rope_type != "linear":
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r} for Gemma: only 'linear' (or none)"
        )
    if "factor" not in params:
        raise ValueError("linear rope scaling is missing the 'factor' field")
    return float(params["factor"])


def _linear_to_hf(factor: float) -> dict[str, Any] | None:
    return None if factor == 1.0 else {"rope_type": "linear", "factor": factor}


def _parse_rope(d: Mapping[str, Any], model_type: str) -> tuple[float, float, float, float]:
    """-> (global theta, global linear factor, local theta, local linear factor)."""
    _check_full_rotary(d)
    params = d.get("rope_parameters")
    default_theta = _DEFAULT_THETA[model_type]
    if model_type == "gemma2":
        # 5.x: one flat rope_parameters dict; 4.x: rope_theta + rope_scaling.
        if isinstance(params, Mapping) and params:
            theta = float(params.get("rope_theta", d.get("rope_theta", default_theta)))
            factor = _linear_factor(params)
        else:
            theta = float(d.get("rope_theta", default_theta))
            raw = d.get("rope_scaling")
            factor = _linear_factor(raw if isinstance(raw, Mapping) else None)
        return theta, factor, theta, factor
    # Gemma 3. 5.x: rope_parameters keyed by layer type; 4.x: rope_theta (global layers),
    # rope_local_base_freq (sliding layers) and rope_scaling (global layers).
    if isinstance(params, Mapping) and params:
        if not set(params) <= {SLIDING, FULL}:
            raise ValueError(
                f"Gemma 3 rope_parameters must be keyed by {SLIDING!r} / {FULL!r}, "
                f"got {sorted(params)}"
            )
        full = params.get(FULL) or {}
        local = params.get(SLIDING) or {}
        theta = float(full.get("rope_theta", d.get("rope_theta", default_theta)))
        local_theta = float(
            local.get("rope_theta", d.get("rope_local_base_freq", _DEFAULT_LOCAL_THETA))
        )
        global_factor, local_factor = _linear_factor(full), _linear_factor(local)
    else:
        theta = float(d.get("rope_theta", default_theta))
        local_theta = float(d.get("rope_local_base_freq", _DEFAULT_LOCAL_THETA))
        raw = d.get("rope_scaling")
        global_factor = _linear_factor(raw if isinstance(raw, Mapping) else None)
        local_factor = 1.0
    if local_factor != 1.0:
        raise ValueError("RoPE scaling on Gemma 3's sliding layers is not supported")
    return theta, global_factor, local_theta, local_factor


def _sliding_layers(d: Mapping[str, Any], model_type: str, num_layers: int) -> tuple[bool, ...]:
    kinds = d.get("layer_types")
    if kinds is None:
        pattern = _DEFAULT_PATTERN[model_type]
        if model_type == "gemma3_text":
            pattern = int(d.get("sliding_window_pattern", pattern))
        if pattern < 1:
            raise ValueError(f"sliding_window_pattern must be >= 1, got {pattern}")
        return tuple(bool((i + 1) % pattern) for i in range(num_layers))
    if len(kinds) != num_layers or any(k not in (SLIDING, FULL) for k in kinds):
        raise ValueError(
            f"layer_types must list {num_layers} entries from {[FULL, SLIDING]}, got {kinds!r}"
        )
    return tuple(k == SLIDING for k in kinds)
