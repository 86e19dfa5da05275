"""Checkpoint loading/saving round trips, config parsing, and the loader's error messages."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from ferrum_server.models import (
    LlamaForCausalLM,
    ModelConfig,
    build_tiny,
    load_model,
    save_hf_folder,
    tiny_config,
)
from safetensors.torch import load_file, save_file

CPU = torch.device("cpu")


def _assert_same_weights(a: LlamaForCausalLM, b: LlamaForCausalLM) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name, t in pa.items():
        assert torch.equal(t, pb[name]), name


@pytest.fixture
def tiny_folder(tmp_path: Path) -> Path:
    save_hf_folder(build_tiny(torch.float32, CPU), tiny_config(), tmp_path / "tiny")
    return tmp_path / "tiny"


def test_single_file_round_trip(tiny_folder: Path) -> None:
    assert (tiny_folder / "model.safetensors").is_file()
    model, config = load_model(str(tiny_folder), dtype=torch.float32, device=CPU)
    assert config == tiny_config()
    _assert_same_weights(model, build_tiny(torch.float32, CPU))


def test_sharded_round_trip(tmp_path: Path) -> None:
    original = build_tiny(torch.float32, CPU, seed=3)
    save_hf_folder(original, tiny_config(), tmp_path, max_shard_bytes=64 * 1024)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    assert all((tmp_path / s).is_file() for s in shards)
    assert index["metadata"]["total_size"] == 4 * tiny_config().num_parameters
    assert "model.layers.1.self_attn.k_proj.weight" in index["weight_map"]
    model, _ = load_model(str(tmp_path), dtype=torch.float32, device=CPU)
    _assert_same_weights(model, original)


def test_load_casts_to_requested_dtype(tiny_folder: Path) -> None:
    model, _ = load_model(str(tiny_folder), dtype=torch.bfloat16, device=CPU)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ref = build_tiny(torch.float32, CPU).embed_tokens.weight.to(torch.bfloat16)
    assert torch.equal(model.embed_tokens.weight, ref)


def test_tiny_source() -> None:
    model, config = load_model("tiny", dtype=torch.float32, device=CPU)
    assert config == tiny_config()
    _assert_same_weights(model, build_tiny(torch.float32, CPU))


def test_tied_embeddings_round_trip(tmp_path: Path) -> None:
    hf = tiny_config().to_hf() | {"tie_word_embeddings": True}
    config = ModelConfig.from_hf(hf)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    save_hf_folder(model, config, tmp_path)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    loaded, _ = load_model(str(tmp_path), dtype=torch.float32, device=CPU)
    assert loaded.lm_head is None
    _assert_same_weights(loaded, model)


# --- error cases -------------------------------------------------------------------------------


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nope"), dtype=torch.float32, device=CPU)


def test_missing_config(tiny_folder: Path) -> None:
    (tiny_folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_model(str(tiny_folder), dtype=torch.float32, device=CPU)


def test_no_safetensors(tiny_folder: Path) -> None:
    (tiny_folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no safetensors"):
        load_model(str(tiny_folder), dtype=torch.float32, device=CPU)


def test_missing_tensor(tiny_folder: Path) -> None:
    path = tiny_folder / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.up_proj"):
        load_model(str(tiny_folder), dtype=torch.float32, device=CPU)


def test_shape_mismatch(tiny_folder: Path) -> None:
    cfg = json.loads((tiny_folder / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tiny_folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"wrong shape.*gate_proj.weight: expected \[96, 64\]"):
        load_model(str(tiny_folder), dtype=torch.float32, device=CPU)


def test_index_names_missing_shard(tmp_path: Path) -> None:
    save_hf_folder(build_tiny(torch.float32, CPU), tiny_config(), tmp_path, max_shard_bytes=65536)
    victim = sorted(tmp_path.glob("model-*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=f"missing shard.*{victim.name}"):
        load_model(str(tmp_path), dtype=torch.float32, device=CPU)


def test_unsupported_architecture(tiny_folder: Path) -> None:
    cfg = json.loads((tiny_folder / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (tiny_folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(str(tiny_folder), dtype=torch.float32, device=CPU)


# --- config parsing ----------------------------------------------------------------------------


def _base(**over: Any) -> dict[str, Any]:
    return tiny_config().to_hf() | over


def test_config_round_trip() -> None:
    assert ModelConfig.from_hf(tiny_config().to_hf()) == tiny_config()
    llama3 = ModelConfig.from_hf(
        _base(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        )
    )
    assert llama3.rope_scaling is not None and llama3.rope_scaling.factor == 8.0
    assert ModelConfig.from_hf(llama3.to_hf()) == llama3


def test_transformers5_rope_parameters_layout() -> None:
    d = _base(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    )
    del d["rope_theta"], d["rope_scaling"]
    config = ModelConfig.from_hf(d)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling is not None and config.rope_scaling.factor == 32.0


def test_family_flags() -> None:
    qwen2 = ModelConfig.from_hf(_base(architectures=["Qwen2ForCausalLM"], model_type="qwen2"))
    assert qwen2.attention_bias and not qwen2.qk_norm
    qwen3 = ModelConfig.from_hf(_base(architectures=None, model_type="qwen3"))
    assert qwen3.qk_norm and not qwen3.attention_bias
    assert ModelConfig.from_hf(_base(eos_token_id=[5, 7])).eos_token_ids == (5, 7)


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope scaling"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "unsupported rope scaling"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "missing the 'low_freq"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 0}, "sliding_window"),
        (
            {"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
             "sliding_window": 128, "layer_types": ["sliding_attention"]},
            "layer_types",
        ),
        (
            {"architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True,
             "sliding_window": 128, "layer_types": ["sliding_attention", "chunked_attention"]},
            "layer_types",
        ),
        ({"architectures": None, "model_type": "phimoe"}, "unsupported model_type 'phimoe'"),
        ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
    ],
)  # fmt: skip
def test_config_rejections(over: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(_base(**over))


def test_mistral_window_covering_context_is_accepted() -> None:
    d = _base(architectures=["MistralForCausalLM"], sliding_window=4096)
    assert ModelConfig.from_hf(d).model_type == "mistral"
    assert ModelConfig.from_hf(d).sliding_windows == ()  # hides nothing: global kernels
    assert ModelConfig.from_hf(_base(architectures=["MistralForCausalLM"], sliding_window=None))


def _layers(n: int, **over: Any) -> dict[str, Any]:
    return _base(num_hidden_layers=n, max_position_embeddings=8192, **over)


def test_sliding_windows_follow_transformers() -> None:
    """Which layers slide, as transformers' Mistral/Qwen2/Qwen3 configs decide it."""
    mistral = {"architectures": ["MistralForCausalLM"]}
    assert ModelConfig.from_hf(_layers(3, **mistral, sliding_window=512)).sliding_windows == (
        512,
        512,
        512,
    )
    # MistralConfig's default window when config.json has none.
    no_field = _layers(2, **mistral)
    no_field.pop("sliding_window", None)
    assert ModelConfig.from_hf(no_field).sliding_windows == (4096, 4096)
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 64}
    # Without use_sliding_window the window is dropped, whatever the other fields say.
    assert ModelConfig.from_hf(_layers(4, **qwen2, max_window_layers=0)).sliding_windows == ()
    on = {**qwen2, "use_sliding_window": True}
    got = ModelConfig.from_hf(_layers(4, **on, max_window_layers=2))
    assert got.sliding_windows == (0, 0, 64, 64)
    assert [got.layer_window(i) for i in range(4)] == [0, 0, 64, 64]
    # max_window_layers defaults to 28: a 4-layer model has no windowed layer then.
    assert ModelConfig.from_hf(_layers(4, **on)).sliding_windows == ()
    kinds = ["sliding_attention", "full_attention", "sliding_attention"]
    explicit = _layers(3, **on, max_window_layers=0, layer_types=kinds)
    assert ModelConfig.from_hf(explicit).sliding_windows == (64, 0, 64)
    qwen3 = {**on, "architectures": ["Qwen3ForCausalLM"], "max_window_layers": 1}
    assert ModelConfig.from_hf(_layers(2, **qwen3)).sliding_windows == (0, 64)
    # Llama has no sliding window, whatever stray fields a config carries.
    assert ModelConfig.from_hf(_layers(2, sliding_window=16)).sliding_windows == ()


def test_sliding_window_config_round_trip() -> None:
    for d in (
        _layers(3, architectures=["MistralForCausalLM"], sliding_window=512),
        _layers(
            4,
            architectures=["Qwen2ForCausalLM"],
            use_sliding_window=True,
            sliding_window=64,
            max_window_layers=1,
        ),
        _layers(
            3,
            architectures=["Qwen3ForCausalLM"],
            use_sliding_window=True,
            sliding_window=64,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ):
        config = ModelConfig.from_hf(d)
        assert config.sliding_windows and ModelConfig.from_hf(config.to_hf()) == config
    with pytest.raises(ValueError, match="sliding_windows has 1 entries for 2 layers"):
        dataclasses.replace(tiny_config(), sliding_windows=(4,))


def test_sizes() -> None:
    c = tiny_config()
    # 2 layers * K and V * 2 kv heads * 16 dims * 2 bytes
    assert c.kv_bytes_per_token(torch.bfloat16) == 2 * 2 * 2 * 16 * 2
    assert c.kv_bytes_per_token(torch.float32) == 2 * c.kv_bytes_per_token(torch.float16)
    for over in ({}, {"architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True},
                 {"architectures": ["Qwen3ForCausalLM"]}, {"attention_bias": True}):  # fmt: skip
        config = ModelConfig.from_hf(_base(**over))
        model = LlamaForCausalLM(config, device=torch.device("meta"))
        assert config.num_parameters == sum(p.numel() for p in model.parameters())
