"""Mixtral and Qwen3-MoE against transformers on small random checkpoints: float32 logits and
greedy tokens, chunked and batched invariance on both CPU backends, bfloat16 error, the config
round trip, and the variants that are refused."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from ferrum_kernels.backend import select_backend
from ferrum_kernels.cpu_linear import PackedLinear, mkldnn_linear_available, release_plain_weights
from ferrum_kernels.cpu_moe import fused_moe_cpu
from ferrum_kernels.moe import ExpertWeights
from ferrum_server.models import LlamaForCausalLM, ModelConfig, load_model, save_hf_folder
from ferrum_server.models.moe_config import MoeSpec
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers_models import PagedRunner, check_chunking_and_batching_invariance
from helpers_moe import MIXTRAL_WINDOW, mixtral_config, qwen3_moe_config, save_moe

PARITY_ATOL = 1e-3
BLOCK_SIZE = 4
DECODE_STEPS = 32
PROMPT_LEN = 20

FAMILIES: dict[str, Any] = {
    "mixtral": mixtral_config,
    "qwen3_moe": qwen3_moe_config,
    "qwen3_moe_normalized": lambda: qwen3_moe_config(norm_topk_prob=True),
}


def _runner(folder: Path, backend: str, *, dtype: torch.dtype = torch.float32, seed: int = 0,
            shuffle: bool = True) -> PagedRunner:  # fmt: skip
    model, config = load_model(str(folder), dtype=dtype, device=torch.device("cpu"))
    model.bind_backend(select_backend("cpu", backend))
    return PagedRunner(
        model, config, num_blocks=64, block_size=BLOCK_SIZE, shuffle=shuffle, seed=seed
    )


def _check_spec(family: str, config: ModelConfig) -> None:
    # Guards against a case silently testing a plainer model than intended.
    assert config.moe is not None
    if family == "mixtral":
        assert config.sliding_windows == (MIXTRAL_WINDOW, MIXTRAL_WINDOW)
        assert config.moe.normalize_top_k and config.moe.num_experts == 4
    else:
        assert [config.is_sparse_layer(i) for i in range(3)] == [True, False, True]
        assert config.qk_norm and config.moe.num_experts == 6
        assert config.moe.normalize_top_k == (family == "qwen3_moe_normalized")


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@torch.no_grad()
def test_parity_with_transformers(family: str, backend: str, tmp_path: Path) -> None:
    """A 20-token prompt in chunks (across Mixtral's window of 6), then 32 greedy decodes: the
    last row's logits within 1e-3 of transformers' at every step, and the same tokens."""
    hf = save_moe(tmp_path, FAMILIES[family]())
    runner = _runner(tmp_path, backend)
    _check_spec(family, runner.config)
    torch.manual_seed(1)
    prompt = torch.randint(0, 256, (PROMPT_LEN,))
    begin = 0
    for end in (4, 11, PROMPT_LEN):
        ours = runner.step([(0, prompt[begin:end].tolist())])[0][-1]
        begin = end
    out = hf(input_ids=prompt[None], use_cache=True)
    ref, past = out.logits[0, -1].float(), out.past_key_values
    assert ours.std().item() > 0.05  # logits are not degenerate: the comparison means something
    for step in range(DECODE_STEPS):
        diff = (ours - ref).abs().max().item()
        assert diff <= PARITY_ATOL, f"step {step}: max abs logit diff {diff}"
        token = int(ref.argmax())
        assert int(ours.argmax()) == token, f"greedy token differs at step {step}"
        ours = runner.step([(0, [token])])[0][-1]
        out = hf(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
        ref, past = out.logits[0, -1].float(), out.past_key_values


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@torch.no_grad()
def test_chunking_and_batching_invariance(family: str, backend: str, tmp_path: Path) -> None:
    """Chunked prefill equals one piece, and a mixed batch (chunks, decodes past the window)
    equals each item alone: experts see different token groups, the rows must not care."""
    save_moe(tmp_path, FAMILIES[family]())
    torch.manual_seed(2)
    check_chunking_and_batching_invariance(lambda **kw: _runner(tmp_path, backend, **kw))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@torch.no_grad()
def test_bf16_error_is_no_worse_than_transformers(family: str, tmp_path: Path) -> None:
    """bfloat16 on the CPU fast paths against the float32 truth, beside transformers' own
    bfloat16 run on the same weights and (teacher-forced) tokens."""
    truth = save_moe(tmp_path, FAMILIES[family]())
    hf16 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    runner = _runner(tmp_path, "cpu", dtype=torch.bfloat16)
    torch.manual_seed(4)
    prompt = torch.randint(0, 256, (PROMPT_LEN,)).tolist()
    runner.step([(0, prompt[:9])])  # a chunked prefill (across Mixtral's window edge)
    ours = [runner.step([(0, prompt[9:])])[0][-1].float()]
    ref, ref16 = truth(input_ids=torch.tensor([prompt])), hf16(input_ids=torch.tensor([prompt]))
    want, theirs = [ref.logits[0, -1].float()], [ref16.logits[0, -1].float()]
    past, past16 = ref.past_key_values, ref16.past_key_values
    for _ in range(16):
        token = torch.tensor([[int(want[-1].argmax())]])
        ours.append(runner.step([(0, [int(token)])])[0][-1].float())
        out = truth(input_ids=token, past_key_values=past, use_cache=True)
        out16 = hf16(input_ids=token, past_key_values=past16, use_cache=True)
        past, past16 = out.past_key_values, out16.past_key_values
        want.append(out.logits[0, -1].float())
        theirs.append(out16.logits[0, -1].float())
    ours_err = torch.stack([(o - w).abs().mean() for o, w in zip(ours, want, strict=True)])
    hf_err = torch.stack([(t - w).abs().mean() for t, w in zip(theirs, want, strict=True)])
    # The margin absorbs kernels that differ by CPU (bf16 dot products or not), not a worse
    # algorithm: the routing weights stay float32 here, as in transformers' Mixtral.
    assert ours_err.mean() <= hf_err.mean() * 1.1, (ours_err.mean(), hf_err.mean())


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@torch.no_grad()
def test_config_round_trip_and_export(family: str, tmp_path: Path) -> None:
    """to_hf() writes back what from_hf() read; transformers loads our export as the same
    model; every expert counts in num_parameters (what capacity figures quote)."""
    hf = save_moe(tmp_path / "hf", FAMILIES[family]())
    cpu = torch.device("cpu")
    model, config = load_model(str(tmp_path / "hf"), dtype=torch.float32, device=cpu)
    assert ModelConfig.from_hf(config.to_hf()) == config
    assert config.num_parameters == sum(p.numel() for p in model.parameters())
    assert config.num_parameters == hf.num_parameters()
    save_hf_folder(model, config, tmp_path / "ours", max_shard_bytes=200_000)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(back(input_ids=ids).logits, hf(input_ids=ids).logits)


@pytest.mark.skipif(not mkldnn_linear_available(), reason="oneDNN cannot pack float32")
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@torch.no_grad()
def test_released_plain_weights_keep_the_logits_and_free_the_experts(
    family: str, tmp_path: Path
) -> None:
    """What a served CPU model does at start-up (startup.build_parts): after the release, the
    same packed GEMMs give the same logits bit for bit, the bytes freed are exactly the plain
    experts' and packed linears' tensors, and export, the torch experts and another dtype are
    refused with clear errors."""
    save_moe(tmp_path, FAMILIES[family]())
    loaded = _runner(tmp_path, "cpu")
    model, config = loaded.model, loaded.config
    experts = [m for m in model.modules() if isinstance(m, ExpertWeights)]
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(experts) == 2 and all(e.is_packed() for e in experts) and linears
    expert_bytes = sum(
        p.numel() * p.element_size() for e in experts for p in (e.gate_up_proj, e.down_proj)
    )
    linear_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)

    def run() -> list[torch.Tensor]:
        """Two prompts (one chunked), then four batched greedy decodes: every step's logits."""
        runner = PagedRunner(model, config, num_blocks=64, block_size=BLOCK_SIZE)
        gen = torch.Generator().manual_seed(5)
        long, short = (torch.randint(0, 256, (n,), generator=gen).tolist() for n in (20, 7))
        out = runner.step([(0, long[:11]), (1, short)])
        out = [runner.step([(0, long[11:])])[0], out[1]]
        logits = list(out)
        for _ in range(4):
            out = runner.step([(i, [int(o[-1].argmax())]) for i, o in enumerate(out)])
            logits += out
        return logits

    before = run()
    assert release_plain_weights(model) == expert_bytes + linear_bytes
    assert all(e.released and e.gate_up_proj.numel() == e.down_proj.numel() == 0 for e in experts)
    assert release_plain_weights(model) == 0
    assert model.bind_backend(select_backend("cpu", "cpu")) == 0  # nothing re-packed
    after = run()
    assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True))
    with pytest.raises(RuntimeError, match="cannot be exported"):
        model.hf_state_dict()
    x = torch.zeros(1, experts[0].hidden_size, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"only their packed .* cannot run"):
        fused_moe_cpu(x, experts[0], torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long))
    model.bind_backend(select_backend("cpu", "torch"))  # its experts need the plain weights
    with pytest.raises(RuntimeError, match="only their packed weights"):
        run()


def test_sparse_layers_follow_decoder_sparse_step() -> None:
    """Which layers are sparse, as transformers builds them (step 2, one layer forced dense)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf_config = qwen3_moe_config(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    config = ModelConfig.from_hf(hf_config.to_dict())
    hf = AutoModelForCausalLM.from_config(hf_config)
    theirs = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in hf.model.layers]
    ours = [config.is_sparse_layer(i) for i in range(6)]
    assert ours == theirs == [False, True, False, False, False, True]
    model = LlamaForCausalLM(config, device=torch.device("meta"))
    assert config.num_parameters == sum(p.numel() for p in model.parameters())


def _mixtral_dict(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = mixtral_config().to_dict()
    d.update(over)
    return d


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (_mixtral_dict(architectures=["Qwen2MoeForCausalLM"]), "shared expert"),
        (_mixtral_dict(architectures=["DeepseekV3ForCausalLM"]), "shared experts"),
        (_mixtral_dict(num_experts=4, num_local_experts=8), "disagree"),
        (_mixtral_dict(num_experts_per_tok=5), "num_experts_per_tok must be in 1..4"),
        (_mixtral_dict(num_local_experts=0), "at least one expert"),
        (
            Qwen3MoeConfig(**{**qwen3_moe_config().to_dict(), "decoder_sparse_step": 0}).to_dict(),
            "decoder_sparse_step must be >= 1",
        ),
    ],
)
def test_refused_moe_configs(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        ModelConfig.from_hf(raw)
    assert "\n" not in str(info.value)  # one line


def test_spec_must_fit_its_architecture() -> None:
    config = ModelConfig.from_hf(_mixtral_dict())
    assert config.moe is not None
    unnormalized = dataclasses.replace(config.moe, normalize_top_k=False)
    with pytest.raises(ValueError, match="Mixtral has a sparse MLP in every layer"):
        dataclasses.replace(config, moe=unnormalized)
    with pytest.raises(ValueError, match="needs its MoE spec"):
        dataclasses.replace(config, moe=None)
    llama = ModelConfig.from_hf({**_mixtral_dict(), "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match="dense model type"):
        dataclasses.replace(llama, moe=MoeSpec(4, 2, 96, normalize_top_k=True))


def test_missing_expert_tensor_is_named(tmp_path: Path) -> None:
    save_moe(tmp_path, mixtral_config())
    weights = load_file(tmp_path / "model.safetensors")
    gone = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    del weights[gone]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"missing 1 tensor.*{gone}"):
        load_model(str(tmp_path), dtype=torch.float32, device=torch.device("cpu"))
    assert json.loads((tmp_path / "config.json").read_text())["num_local_experts"] == 4
