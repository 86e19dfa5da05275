"""Mixture-of-experts hyper-parameters (Mixtral, Qwen3-MoE), read from and written back to a
Hugging Face ``config.json`` with transformers' defaults for absent fields.

* Mixtral: every layer is sparse, ``num_local_experts`` experts of ``intermediate_size``, top
  ``num_experts_per_tok``, the chosen weights always renormalised to sum to 1.
* Qwen3-MoE: layer i is sparse when ``(i + 1) % decoder_sparse_step == 0`` and i is not in
  ``mlp_only_layers``; other layers keep a dense MLP of ``intermediate_size``. Experts have
  ``moe_intermediate_size``; ``norm_topk_prob`` says whether the chosen weights are renormalised.

transformers 5 treats ``num_experts`` and ``num_local_experts`` as one field in both families, so
either key is read (they must agree when both are given).

MoE designs with parts these models lack (a shared expert as in Qwen2-MoE and DeepSeek, grouped
or biased routing) are refused by architecture, with the reason (``REFUSED_ARCHITECTURES``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MOE_MODEL_TYPES = ("mixtral", "qwen3_moe")

# Architectures that look close but need what is not implemented here: one line each, quoted
# by the config parser instead of the generic "unsupported architecture".
REFUSED_ARCHITECTURES: dict[str, str] = {
    "Qwen2MoeForCausalLM": "Qwen2-MoE adds a gated shared expert to every sparse layer",
    "DeepseekV2ForCausalLM": "DeepSeek-V2 has shared experts, grouped routing and MLA attention",
    "DeepseekV3ForCausalLM": "DeepSeek-V3 has shared experts, biased sigmoid routing and MLA",
    "OlmoeForCausalLM": "OLMoE normalises q/k over all heads at once",
    "PhimoeForCausalLM": "PhiMoE routes with sparsemixer",
}

# transformers' defaults when config.json omits a field (MixtralConfig, Qwen3MoeConfig).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": {"num_experts": 8, "num_experts_per_tok": 2},
    "qwen3_moe": {
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
    },
}


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """How a model's sparse layers route and size their experts."""

    num_experts: int
    num_experts_per_token: int  # top-k
    expert_intermediate_size: int
    normalize_top_k: bool  # renormalise the chosen experts' weights to sum to 1
    # Layer i is sparse when (i + 1) % sparse_step == 0 and i is not in dense_layers.
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"a MoE model needs at least one expert, got {self.num_experts}")
        if not 1 <= self.num_experts_per_token <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in 1..{self.num_experts} (num_experts), "
                f"got {self.num_experts_per_token}"
            )
        if self.expert_intermediate_size < 1:
            raise ValueError(
                f"the expert intermediate size must be >= 1, got {self.expert_intermediate_size}"
            )
        if self.sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.sparse_step}")
        if any(i < 0 for i in self.dense_layers):
            raise ValueError(f"mlp_only_layers must be layer indices >= 0, got {self.dense_layers}")

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` runs the experts (else a dense MLP)."""
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0

    @classmethod
    def from_hf(
        cls, d: Mapping[str, Any], model_type: str, intermediate_size: int
    ) -> MoeSpec | None:
        """The spec of a ``config.json`` dict; None for a dense model type."""
        if model_type not in MOE_MODEL_TYPES:
            return None
        defaults = _DEFAULTS[model_type]

        def get(key: str) -> Any:
            value = d.get(key)
            return defaults[key] if value is None else value

        num_experts = _num_experts(d, int(defaults["num_experts"]))
        top_k = int(get("num_experts_per_tok"))
        if model_type == "mixtral":
            return cls(num_experts, top_k, intermediate_size, normalize_top_k=True)
        dense = d.get("mlp_only_layers") or []
        return cls(
            num_experts,
            top_k,
            int(get("moe_intermediate_size")),
            normalize_top_k=bool(get("norm_topk_prob")),
            sparse_step=int(get("decoder_sparse_step")),
            dense_layers=tuple(sorted({int(i) for i in dense})),
        )

    def to_hf(self, model_type: str) -> dict[str, Any]:
        """The config.json fields that give transformers (4.x and 5.x) this spec."""
        if model_type == "mixtral":
            return {
                "num_local_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_token,
            }
        return {
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_token,
            "moe_intermediate_size": self.expert_intermediate_size,
            "norm_topk_prob": self.normalize_top_k,
            "decoder_sparse_step": self.sparse_step,
            "mlp_only_layers": list(self.dense_layers),
        }

    def check_for(self, model_type: str, intermediate_size: int) -> None:
        """Raise when this spec is not one ``model_type``'s config.json can express."""
        if model_type not in MOE_MODEL_TYPES:
            raise ValueError(f"{model_type} is a dense model type; it takes no MoE spec")
        if model_type == "mixtral" and (
            not self.normalize_top_k
            or self.sparse_step != 1
            or self.dense_layers
            or self.expert_intermediate_size != intermediate_size
        ):
            raise ValueError(
                "Mixtral has a sparse MLP in every layer, renormalises the chosen weights and "
                "sizes its experts with intermediate_size"
            )


def _num_experts(d: Mapping[str, Any], default: int) -> int:
    given = {d[k] for k in ("num_experts", "num_local_experts") if d.get(k) is not None}
    if len(given) > 1:
        raise ValueError(f"num_experts and num_local_experts disagree: {sorted(given)}")
    return int(given.pop()) if given else default
