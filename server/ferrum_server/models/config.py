"""Model hyper-parameters parsed from (and written back to) a Hugging Face ``config.json``.

Supported: the Llama family, Llama (1-3.x), Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k
RMSNorm) and Phi-3 (fused qkv / gate-up checkpoint tensors, LongRoPE); the mixture-of-experts
relatives Mixtral (Mistral attention) and Qwen3-MoE (Qwen3 attention), whose expert
hyper-parameters are one ``MoeSpec`` (``moe_config``); and Gemma 2 / Gemma 3 text models, whose
extra hyper-parameters live in ``ModelConfig.gemma`` (``gemma_spec.GemmaSpec``). Anything else
is rejected up front with a message naming the offending field, rather than producing silently
wrong logits later.

Sliding-window attention is read exactly as transformers reads it: Mistral windows every layer
with ``sliding_window`` (4096 when the field is absent, as in ``MistralConfig``); Mixtral and
Phi-3 likewise, but with no window when absent; Qwen3-MoE windows every layer when
``use_sliding_window``; Qwen2/Qwen3 window only when ``use_sliding_window`` is true and
``sliding_window`` is set, and then only the layers ``layer_types`` names
``"sliding_attention"`` (by default layers ``i >= max_window_layers``, 28 when absent). A
window of at least ``max_position_embeddings`` hides nothing any sequence can reach, so it is
kept as global attention (the faster kernels).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias

import torch

from ferrum_server.models.gemma_spec import GEMMA_MODEL_TYPES, GemmaSpec
from ferrum_server.models.moe_config import MOE_MODEL_TYPES, REFUSED_ARCHITECTURES, MoeSpec

# HF architecture class name -> model_type, for the families this executor can run.
_ARCH_TO_MODEL_TYPE: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
}
_MODEL_TYPE_TO_ARCH: dict[str, str] = {v: k for k, v in _ARCH_TO_MODEL_TYPE.items()}


@dataclass(frozen=True, slots=True)
class Llama3RopeScaling:
    """Llama-3 ("llama3") frequency-dependent RoPE scaling."""

    rope_type: ClassVar[str] = "llama3"
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> Llama3RopeScaling:
        try:
            return cls(
                factor=float(d["factor"]),
                low_freq_factor=float(d["low_freq_factor"]),
                high_freq_factor=float(d["high_freq_factor"]),
                original_max_position_embeddings=int(d["original_max_position_embeddings"]),
            )
        except KeyError as e:
            raise ValueError(f"llama3 rope scaling is missing the {e.args[0]!r} field") from e

    def to_hf(self) -> dict[str, Any]:
        return {
            "rope_type": self.rope_type,
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


@dataclass(frozen=True, slots=True)
class LongRopeScaling:
    """LongRoPE ("longrope"; Phi-3's "su", and "yarn" in a Phi-3 config, are transformers' older
    names for it): every inverse frequency divided by a per-frequency factor, one list for
    sequences within ``original_max_position_embeddings`` and one beyond it, and cos/sin
    multiplied by an attention factor.

    transformers picks the list per forward call from that call's longest position, so a
    sequence's early keys may be rotated with the short list and its later ones with the long
    one. A paged server cannot do that (cached keys would go stale when a sequence crosses the
    edge, and one step mixes sequences of every length), so the list is chosen once, from the
    longest sequence the server admits (``long_factors_for``), as vLLM does."""

    rope_type: ClassVar[str] = "longrope"
    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    factor: float | None = None  # as config.json gives it; None: max positions / original
    attention_factor: float | None = None  # as given; None: derived from the factor

    @classmethod
    def from_hf(
        cls, d: Mapping[str, Any], *, original_max_position_embeddings: int, rotary_pairs: int
    ) -> LongRopeScaling:
        extra = sorted(k for k in ("short_mscale", "long_mscale") if d.get(k) is not None)
        if extra:
            # transformers ignores these and vLLM applies them: no one right answer to match.
            raise ValueError(f"longrope scaling with {', '.join(extra)} is not supported")
        try:
            short, long = d["short_factor"], d["long_factor"]
        except KeyError as e:
            raise ValueError(f"longrope scaling is missing the {e.args[0]!r} field") from e
        for name, factors in (("short_factor", short), ("long_factor", long)):
            if not isinstance(factors, list) or len(factors) != rotary_pairs:
                raise ValueError(
                    f"longrope {name} must list {rotary_pairs} numbers (head_dim / 2), "
                    f"got {factors!r}"
                )
        factor, attention = d.get("factor"), d.get("attention_factor")
        return cls(
            short_factor=tuple(float(x) for x in short),
            long_factor=tuple(float(x) for x in long),
            original_max_position_embeddings=original_max_position_embeddings,
            factor=None if factor is None else float(factor),
            attention_factor=None if attention is None else float(attention),
        )

    def to_hf(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "rope_type": self.rope_type,
            "short_factor": list(self.short_factor),
            "long_factor": list(self.long_factor),
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }
        if self.factor is not None:
            d["factor"] = self.factor
        if self.attention_factor is not None:
            d["attention_factor"] = self.attention_factor
        return d

    def long_factors_for(self, max_sequence_length: int) -> bool:
        """Whether a server admitting sequences of up to ``max_sequence_length`` tokens rotates
        with the long factors (for every position: see the class docstring)."""
        return max_sequence_length > self.original_max_position_embeddings

    def attention_scaling(self, max_position_embeddings: int) -> float:
        """The cos/sin multiplier, as transformers derives it."""
        if self.attention_factor is not None:
            return self.attention_factor
        original = self.original_max_position_embeddings
        factor = self.factor if self.factor is not None else max_position_embeddings / original
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(original))


# The RoPE scaling variants supported, told apart by their ``rope_type``.
RopeScaling: TypeAlias = Llama3RopeScaling | LongRopeScaling


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # HF class name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Per layer: the sliding window (a query at p sees keys in (p - w, p]), 0 for global
    # attention. Empty means every layer is global.
    sliding_windows: tuple[int, ...] = ()
    # The experts of a mixture-of-experts model (Mixtral, Qwen3-MoE); None for a dense one.
    moe: MoeSpec | None = None
    # Gemma 2 / Gemma 3 only: (1 + w) norms, GeGLU, soft-caps, local/global RoPE (see gemma_spec).
    gemma: GemmaSpec | None = None

    def __post_init__(self) -> None:
        if self.architecture not in _ARCH_TO_MODEL_TYPE:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: "
                f"{sorted(_ARCH_TO_MODEL_TYPE)}"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise ValueError(
                f"sliding_windows has {len(self.sliding_windows)} entries for "
                f"{self.num_layers} layers"
            )
        if any(w < 0 for w in self.sliding_windows):
            raise ValueError(f"sliding windows must be >= 0, got {self.sliding_windows}")
        if self.moe is not None:
            self.moe.check_for(self.model_type, self.intermediate_size)
        elif self.model_type in MOE_MODEL_TYPES:
            raise ValueError(f"{self.architecture} needs its MoE spec (moe=)")

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` runs experts (a MoE model's sparse layer) or a dense MLP."""
        return self.moe is not None and self.moe.is_sparse(layer)
        if (self.gemma is not None) != (self.model_type in GEMMA_MODEL_TYPES):
            raise ValueError(f"{self.architecture} needs a Gemma spec exactly when it is Gemma")
        if self.gemma is not None and len(self.gemma.sliding_layers) != self.num_layers:
            raise ValueError(
                f"the Gemma spec lists {len(self.gemma.sliding_layers)} layer types for "
                f"{self.num_layers} layers"
            )

    def layer_window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window, 0 for global attention."""
        return self.sliding_windows[layer] if self.sliding_windows else 0

    @property
    def model_type(self) -> str:
        return _ARCH_TO_MODEL_TYPE[self.architecture]

    @property
    def o_proj_bias(self) -> bool:
        # Qwen2 puts bias on q/k/v only; Llama/Qwen3's attention_bias also covers o_proj.
        return self.attention_bias and self.model_type != "qwen2"

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Parse a HF ``config.json`` dict (transformers 4.x or 5.x field layout)."""
        architecture = _resolve_architecture(d)
        model_type = _ARCH_TO_MODEL_TYPE[architecture]

        def req(key: str) -> Any:
            if key not in d:
                raise ValueError(f"config.json for {architecture} is missing required {key!r}")
            return d[key]

        gemma = model_type in GEMMA_MODEL_TYPES
        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu" and not gemma:  # Gemma reads hidden_activation (gemma_spec)
            raise ValueError(f"unsupported hidden_act {hidden_act!r}: only 'silu' is supported")
        if d.get("mlp_bias", False):
            raise ValueError("mlp_bias=true is not supported")

        hidden_size = int(req("hidden_size"))
        num_heads = int(req("num_attention_heads"))
        # Gemma's config classes default these to fixed numbers (head_dim 256, 4 KV heads),
        # not to the Llama rule below: a Gemma config.json must state them.
        num_kv_heads = int(
            req("num_key_value_heads") if gemma else d.get("num_key_value_heads") or num_heads
        )
        head_dim = int(req("head_dim") if gemma else d.get("head_dim") or hidden_size // num_heads)
        max_pos = int(req("max_position_embeddings"))
        num_layers = int(req("num_hidden_layers"))

        gemma_spec: GemmaSpec | None = None
        if gemma:
            rope_theta, gemma_spec = GemmaSpec.from_hf(d, model_type, num_layers)
            rope_scaling = None  # Gemma's linear scaling lives in the spec
        else:
            rope_theta, rope_scaling = _parse_rope(d, model_type, head_dim, max_pos)
        windows = _sliding_windows(d, model_type, num_layers, max_pos, gemma_spec)

        eos = d.get("eos_token_id")
        eos_ids: tuple[int, ...]
        if eos is None:
            eos_ids = ()
        elif isinstance(eos, list):
            eos_ids = tuple(int(x) for x in eos)
        else:
            eos_ids = (int(eos),)
        bos = d.get("bos_token_id")

        return cls(
            architecture=architecture,
            vocab_size=int(req("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(req("intermediate_size")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            # Gemma's config classes tie the LM head unless told otherwise.
            tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
            attention_bias=_attention_bias(d, model_type),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            sliding_windows=windows,
            moe=MoeSpec.from_hf(d, model_type, int(req("intermediate_size"))),
            gemma=gemma_spec,
        )

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` dict that transformers (4.45+ and 5.x) loads as the same model."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_hf(),
            **self._original_positions_to_hf(),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": _eos_to_hf(self.eos_token_ids),
            "torch_dtype": "float32",
        }
        if self.model_type in ("llama", "qwen3", "qwen3_moe", *GEMMA_MODEL_TYPES):
            d["attention_bias"] = self.attention_bias
        if self.gemma is not None:
            del d["hidden_act"]
            d.update(self.gemma.to_hf(self.model_type, self.rope_theta))
            return d
        d.update(self._sliding_window_to_hf())
        if self.moe is not None:
            d.update(self.moe.to_hf(self.model_type))
        return d

    def _original_positions_to_hf(self) -> dict[str, Any]:
        # Phi-3 reads LongRoPE's original length from the top level (4096 when absent there).
        s = self.rope_scaling
        if isinstance(s, LongRopeScaling):
            return {"original_max_position_embeddings": s.original_max_position_embeddings}
        return {}

    def _sliding_window_to_hf(self) -> dict[str, Any]:
        windows = {w for w in self.sliding_windows if w}
        if len(windows) > 1:
            raise ValueError(
                f"{self.architecture} config.json has one sliding_window; layers use {windows}"
            )
        window = windows.pop() if windows else None
        if self.model_type in ("mistral", "mixtral", "qwen3_moe", "phi3"):
            if window is not None and set(self.sliding_windows) != {window}:
                raise ValueError(f"{self.architecture} windows every layer or none")
            if self.model_type == "qwen3_moe":
                return {"use_sliding_window": window is not None, "sliding_window": window}
            return {"sliding_window": window}
        if self.model_type in ("qwen2", "qwen3"):
            if window is None:
                return {"use_sliding_window": False}
            kinds = ["sliding_attention" if w else "full_attention" for w in self.sliding_windows]
            return {
                "use_sliding_window": True,
                "sliding_window": window,
                # transformers 4.x reads max_window_layers, 5.x layer_types; write both.
                "max_window_layers": kinds.index("sliding_attention"),
                "layer_types": kinds,
            }
        if window is not None:
            raise ValueError(f"{self.architecture} has no sliding-window config fields")
        return {}

    def kv_bytes_per_token(self, dtype: torch.dtype, kv_heads: int = 0) -> int:
        """Bytes of KV cache one token occupies across all layers (K and V), for ``kv_heads``
        heads per layer (a tensor-parallel rank's own; 0 = all of the model's)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * (kv_heads or self.num_kv_heads) * self.head_dim * elem

    @property
    def num_parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        q_out, kv_out = self.num_heads * d, self.num_kv_heads * d
        attn = h * (q_out + 2 * kv_out) + q_out * h
        if self.attention_bias:
            attn += q_out + 2 * kv_out
        if self.o_proj_bias:
            attn += h
        if self.qk_norm:
            attn += 2 * d
        norms = 4 if self.gemma is not None else 2  # Gemma adds pre/post-feedforward norms
        per_layer = attn + norms * h  # + the RMSNorm weights
        mlps = sum(self._mlp_parameters(layer) for layer in range(self.num_layers))
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embed + self.num_layers * per_layer + mlps + h + head

    def _mlp_parameters(self, layer: int) -> int:
        """A layer's MLP: every expert and the router for a sparse layer, else the dense MLP."""
        h = self.hidden_size
        if self.moe is not None and self.moe.is_sparse(layer):
            experts = self.moe.num_experts
            return experts * 3 * h * self.moe.expert_intermediate_size + experts * h
        return 3 * h * self.intermediate_size


def _resolve_architecture(d: Mapping[str, Any]) -> str:
    archs = d.get("architectures") or []
    model_type = d.get("model_type")
    if archs:
        arch = str(archs[0])
        if arch in REFUSED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}: {REFUSED_ARCHITECTURES[arch]}")
        if arch not in _ARCH_TO_MODEL_TYPE:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: {sorted(_ARCH_TO_MODEL_TYPE)}"
            )
        return arch
    if model_type in _MODEL_TYPE_TO_ARCH:
        return _MODEL_TYPE_TO_ARCH[str(model_type)]
    raise ValueError(
        f"unsupported model_type {model_type!r} (no 'architectures' given); supported: "
        f"{sorted(_MODEL_TYPE_TO_ARCH)}"
    )


def _parse_rope(
    d: Mapping[str, Any], model_type: str, head_dim: int, max_pos: int
) -> tuple[float, RopeScaling | None]:
    # transformers 5 folds theta and scaling into one "rope_parameters" dict; 4.x keeps them apart.
    params = d.get("rope_parameters")
    if (
        isinstance(params, Mapping)
        and "rope_theta" in params
        and not isinstance(params.get("rope_theta"), Mapping)
    ):
        theta = float(params["rope_theta"])
        scaling = _rope_scaling(params, d, model_type, head_dim, max_pos)
        _check_partial_rotary(params)
    else:
        theta = float(d.get("rope_theta", 10000.0))
        raw = d.get("rope_scaling")
        scaling = None
        if isinstance(raw, Mapping):
            scaling = _rope_scaling(raw, d, model_type, head_dim, max_pos)
            _check_partial_rotary(raw)
    _check_partial_rotary(d)
    return theta, scaling


def _rope_scaling(
    r: Mapping[str, Any], d: Mapping[str, Any], model_type: str, head_dim: int, max_pos: int
) -> RopeScaling | None:
    """Parse a ``rope_scaling`` / ``rope_parameters`` dict ``r`` of config ``d``; ``None`` for
    plain RoPE."""
    rope_type = r.get("rope_type", r.get("type"))
    if model_type == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi3Config renames both
    if rope_type in (None, "default"):
        return None
    if rope_type == "llama3":
        return Llama3RopeScaling.from_hf(r)
    if rope_type == "longrope":
        return LongRopeScaling.from_hf(
            r,
            original_max_position_embeddings=_original_positions(r, d, model_type, max_pos),
            rotary_pairs=head_dim // 2,
        )
    raise ValueError(
        f"unsupported rope scaling type {rope_type!r}: only 'llama3', 'longrope' (Phi-3's "
        "'su') or no scaling are supported"
    )


def _original_positions(
    r: Mapping[str, Any], d: Mapping[str, Any], model_type: str, max_pos: int
) -> int:
    # transformers prefers the config's top-level field (Phi3Config always has one: 4096 by
    # default) over the scaling dict's, which defaults to max_position_embeddings.
    top = d.get("original_max_position_embeddings")
    if top is None and model_type == "phi3":
        top = _PHI3_ORIGINAL_MAX_POSITIONS
    return int(top if top is not None else r.get("original_max_position_embeddings", max_pos))


def _attention_bias(d: Mapping[str, Any], model_type: str) -> bool:
    # Qwen2 hard-codes bias on q/k/v and Phi-3 has none; the others read the (rare)
    # attention_bias flag.
    if model_type in ("qwen2", "phi3"):
        return model_type == "qwen2"
    return bool(d.get("attention_bias", False))


def _check_partial_rotary(d: Mapping[str, Any]) -> None:
    factor = d.get("partial_rotary_factor", 1.0)
    if factor not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={factor} is not supported (only 1.0)")


# transformers' defaults when config.json omits a field (Mistral, Qwen2/3, Phi3 configs).
_DEFAULT_SLIDING_WINDOW = 4096
_PHI3_ORIGINAL_MAX_POSITIONS = 4096
_DEFAULT_MAX_WINDOW_LAYERS = 28
_LAYER_KINDS = ("full_attention", "sliding_attention")


def _sliding_windows(
    d: Mapping[str, Any],
    model_type: str,
    num_layers: int,
    max_pos: int,
    gemma: GemmaSpec | None = None,
) -> tuple[int, ...]:
    """Per-layer windows (0 = global) as transformers applies them; () when all are global."""
    raw = d.get("sliding_window", _DEFAULT_SLIDING_WINDOW)
    if gemma is not None:
        # Gemma windows the layers its layer_types (or pattern) names "sliding_attention".
        windowed = list(gemma.sliding_layers)
    elif model_type in ("mistral", "mixtral", "phi3"):
        # They window every layer with config.sliding_window (layer_types is ignored);
        # MixtralConfig's and Phi3Config's default is no window.
        if model_type in ("mixtral", "phi3"):
            raw = d.get("sliding_window")
        windowed = [True] * num_layers
    elif model_type == "qwen3_moe":
        # Qwen3MoeConfig drops the window unless use_sliding_window; then every layer slides.
        if not d.get("use_sliding_window", False):
            return ()
        windowed = [True] * num_layers
    elif model_type in ("qwen2", "qwen3"):
        # Qwen2/3Config drop the window unless use_sliding_window; layer_types (or the
        # max_window_layers rule) then picks the windowed layers.
        if not d.get("use_sliding_window", False):
            return ()
        kinds = d.get("layer_types")
        if kinds is None:
            first = int(d.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS))
            kinds = [_LAYER_KINDS[int(i >= first)] for i in range(num_layers)]
        if len(kinds) != num_layers or any(k not in _LAYER_KINDS for k in kinds):
            raise ValueError(
                f"layer_types must list {num_layers} entries from {list(_LAYER_KINDS)}, "
                f"got {kinds!r}"
            )
        windowed = [k == "sliding_attention" for k in kinds]
    else:
        return ()
    if raw is None:
        return ()
    window = int(raw)
    if window < 1:
        raise ValueError(f"sliding_window must be >= 1 (or null), got {raw!r}")
    if window >= max_pos or not any(windowed):
        return ()  # hides no position a sequence can reach
    return tuple(window if w else 0 for w in windowed)


def _eos_to_hf(eos: tuple[int, ...]) -> int | list[int] | None:
    if not eos:
        return None
    return eos[0] if len(eos) == 1 else list(eos)
