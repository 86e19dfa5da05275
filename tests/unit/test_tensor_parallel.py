"""Tensor parallelism (issue #16): the split model against the whole one.

Two gloo ranks (spawned once for every model: the Llama family, Phi-3, Gemma 2 and 3, Mixtral
and Qwen3-MoE) run the same paged step script as the whole model: float32 logits agree within
1e-4 with it and with transformers, and greedy decoding picks the same 32 tokens. The start-up
check refuses, in one line naming the dimension and the numbers, every model that cannot be
split, before any weight is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from ferrum_kernels.backend import cpu_backend
from ferrum_server.models import ModelConfig, load_model
from ferrum_server.models.llama import LlamaForCausalLM
from ferrum_server.models.registry import model_class
from ferrum_server.models.weight_shards import shard_weight_map
from ferrum_server.parallel import (
    SINGLE_RANK,
    TensorParallel,
    check_tensor_parallel,
    collective_backend,
)
from ferrum_server.parallel.sharding import attention_shard, vocab_shard
from helpers_parallel import (
    GREEDY_STEPS,
    hf_logits,
    parallel_cases,
    run_ranks,
    run_script,
    save_case,
)

TP_ATOL = 1e-4


def test_two_ranks_match_one_rank_and_transformers(tmp_path: Path) -> None:
    cases = []
    whole: dict[str, list[torch.Tensor]] = {}
    whole_greedy: dict[str, list[int]] = {}
    reference: dict[str, list[torch.Tensor]] = {}
    for name, hf_config in parallel_cases().items():
        folder = tmp_path / name
        reference[name] = hf_logits(save_case(folder, hf_config))
        result = run_script(folder, SINGLE_RANK, GREEDY_STEPS)
        whole[name] = result.logits
        whole_greedy[name] = result.greedy
        cases.append((name, folder, GREEDY_STEPS))
    ranks = run_ranks(2, cases, tmp_path / "ranks")
    for name in whole:
        for rank, results in enumerate(ranks):
            split = results[name].logits
            for seq, (ours, one, hf) in enumerate(
                zip(split, whole[name], reference[name], strict=True)
            ):
                where = f"{name}, rank {rank}, sequence {seq}"
                assert ours.shape == one.shape == hf.shape, where
                assert (ours - one).abs().max().item() <= TP_ATOL, where
                assert (ours - hf).abs().max().item() <= TP_ATOL, where
            assert len(whole_greedy[name]) == GREEDY_STEPS
            assert results[name].greedy == whole_greedy[name], f"{name}, rank {rank}"


def _config(**changes: int) -> ModelConfig:
    fields: dict[str, Any] = dict(
        architecture="LlamaForCausalLM",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
    )
    fields.update(changes)
    return ModelConfig(**fields)


@pytest.mark.parametrize(
    ("changes", "world_size", "message"),
    [
        (
            {"num_heads": 6, "num_kv_heads": 2},
            4,
            "tensor parallelism over 4 ranks: num_attention_heads (6) is not divisible by 4",
        ),
        (
            {"num_heads": 12, "num_kv_heads": 4},
            6,
            "tensor parallelism over 6 ranks: num_key_value_heads (4) neither divides nor is "
            "divisible by 6",
        ),
        (
            {"intermediate_size": 100},
            8,
            "tensor parallelism over 8 ranks: intermediate_size (100) is not divisible by 8",
        ),
    ],
)
def test_indivisible_dimensions_are_refused_in_one_line(
    changes: dict[str, int], world_size: int, message: str
) -> None:
    with pytest.raises(ValueError) as refused:
        check_tensor_parallel(_config(**changes), world_size)
    assert str(refused.value) == message
    # The model itself refuses to be built split the same way.
    with pytest.raises(ValueError, match="tensor parallelism over"):
        LlamaForCausalLM(
            _config(**changes),
            device=torch.device("meta"),
            tp=TensorParallel(rank=0, world_size=world_size),
        )


def test_splittable_dimensions_pass() -> None:
    for world_size in (1, 2, 4, 8):  # 4 KV heads: split over 2 and 4, replicated over 8
        check_tensor_parallel(_config(), world_size)
    check_tensor_parallel(_config(vocab_size=251), 2)  # the vocabulary is padded, never refused


def _hf_config(name: str, **over: Any) -> ModelConfig:
    """A ModelConfig of one of the small families (``helpers_*``), with fields changed."""
    from helpers_models import gemma_hf_config
    from helpers_moe import mixtral_config, qwen3_moe_config

    if name in ("gemma2", "gemma3"):
        hf = gemma_hf_config(name, **over)
    else:
        hf = {"mixtral": mixtral_config, "qwen3-moe": qwen3_moe_config}[name](**over)
    return ModelConfig.from_hf(hf.to_dict())


@pytest.mark.parametrize(
    ("family", "over", "world_size", "message"),
    [
        (
            "mixtral",
            {"intermediate_size": 90},
            4,
            "tensor parallelism over 4 ranks: intermediate_size (90) is not divisible by 4",
        ),
        (
            "qwen3-moe",
            {"moe_intermediate_size": 50},
            4,
            "tensor parallelism over 4 ranks: moe_intermediate_size (50) is not divisible by 4",
        ),
        (  # the dense layer 1 splits intermediate_size too
            "qwen3-moe",
            {"intermediate_size": 130},
            4,
            "tensor parallelism over 4 ranks: intermediate_size (130) is not divisible by 4",
        ),
        (
            "gemma2",
            {"intermediate_size": 126},
            4,
            "tensor parallelism over 4 ranks: intermediate_size (126) is not divisible by 4",
        ),
        (
            "gemma3",
            {"num_attention_heads": 2, "num_key_value_heads": 1},
            4,
            "tensor parallelism over 4 ranks: num_attention_heads (2) is not divisible by 4",
        ),
    ],
)
def test_moe_and_gemma_indivisible_dimensions_are_refused_in_one_line(
    family: str, over: dict[str, Any], world_size: int, message: str, tmp_path: Path
) -> None:
    config = _hf_config(family, **over)
    check_tensor_parallel(config, 1)
    with pytest.raises(ValueError) as refused:
        check_tensor_parallel(config, world_size)
    assert str(refused.value) == message
    # Before any weight is read: a folder with config.json alone is refused with that line.
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf()))
    with pytest.raises(ValueError) as loading:
        load_model(
            str(tmp_path),
            dtype=torch.float32,
            device=torch.device("cpu"),
            tp=TensorParallel(rank=0, world_size=world_size),
        )
    assert str(loading.value) == message


def test_moe_and_gemma_split_where_divisible() -> None:
    # model.kv_heads (which sizes a rank's KV pool) is the rank's share: 2 KV heads split over
    # 2 ranks, replicated over 4; Gemma 3 with 1 KV head replicates it on every rank.
    cases = [(f, {}, n, 1) for f in ("gemma2", "gemma3", "mixtral", "qwen3-moe") for n in (2, 4)]
    cases += [("gemma3", {"num_key_value_heads": 1}, n, 1) for n in (2, 4)]
    for family, over, world_size, kv_heads in cases:
        config = _hf_config(family, **over)
        split = model_class(config)(
            config, device=torch.device("meta"), tp=TensorParallel(world_size - 1, world_size)
        )
        where = f"{family} {over} over {world_size}"
        assert split.kv_heads == kv_heads, where
        layer = split.layers[0]
        assert (layer.num_heads, layer.num_kv_heads) == (4 // world_size, kv_heads), where
    # A Qwen3-MoE whose layers are all sparse has no dense MLP: its intermediate_size is unused.
    check_tensor_parallel(_hf_config("qwen3-moe", mlp_only_layers=[], intermediate_size=130), 4)


def test_each_rank_reads_its_columns_of_every_expert() -> None:
    config = _hf_config("qwen3-moe")  # 6 experts of 48 in layers 0 and 2; layer 1 dense (128)
    model = LlamaForCausalLM(config, device=torch.device("meta"), tp=TensorParallel(1, 2))
    entries = {e.name: e for e in shard_weight_map(model)}
    gate_up = entries["layers.0.moe.experts.gate_up_proj"].slices
    assert [(s.hf_name.split("experts.")[1], s.dim, s.start, s.length) for s in gate_up] == [
        (f"{e}.{w}.weight", 0, 24, 24) for e in range(6) for w in ("gate_proj", "up_proj")
    ]
    down = entries["layers.2.moe.experts.down_proj"].slices
    assert [(s.hf_name.split("experts.")[1], s.dim, s.start, s.length) for s in down] == [
        (f"{e}.down_proj.weight", 1, 24, 24) for e in range(6)
    ]
    assert entries["layers.0.moe.gate.weight"].slices[0].length is None  # the router: whole
    (dense_down,) = entries["layers.1.down_proj.weight"].slices
    assert (dense_down.dim, dense_down.start, dense_down.length) == (1, 64, 64)
    # The rank's experts hold I/N columns: [E * 2 * 24, hidden] and [E * hidden, 24].
    experts = model.layers[0].moe.experts
    assert tuple(experts.gate_up_proj.shape) == (6 * 2 * 24, 64)
    assert tuple(experts.down_proj.shape) == (6 * 64, 24)


def test_refused_before_any_weight_is_read(tmp_path: Path) -> None:
    # A config alone, without a single weight file: the split is refused first.
    (tmp_path / "config.json").write_text(json.dumps(_config(num_heads=6, num_kv_heads=2).to_hf()))
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) is not divisible by 4"):
        load_model(
            str(tmp_path),
            dtype=torch.float32,
            device=torch.device("cpu"),
            tp=TensorParallel(rank=0, world_size=4),
        )


def test_kv_heads_replicate_when_ranks_outnumber_them() -> None:
    # 8 ranks, 4 KV heads, 16 query heads: each KV head on 2 ranks, each rank 2 query heads
    # of that KV head's GQA group (4 query heads per KV head).
    shards = [attention_shard(16, 4, rank, 8) for rank in range(8)]
    assert [s.kv_start for s in shards] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(s.kv_heads == 1 and s.q_heads == 2 for s in shards)
    for s in shards:
        assert all(q // 4 == s.kv_start for q in range(s.q_start, s.q_start + s.q_heads))
    # 2 ranks, 4 KV heads: split, 2 each.
    assert [(s.kv_start, s.kv_heads) for s in (attention_shard(8, 4, r, 2) for r in (0, 1))] == [
        (0, 2),
        (2, 2),
    ]


def test_each_rank_reads_its_heads_of_the_fused_qkv() -> None:
    config = _config()  # 8 query heads, 4 KV heads of 8 dims
    model = LlamaForCausalLM(config, device=torch.device("meta"), tp=TensorParallel(1, 2))
    qkv = next(e for e in shard_weight_map(model) if e.name == "layers.0.qkv_proj.weight")
    got = [(s.hf_name.rsplit(".", 2)[-2], s.start, s.length) for s in qkv.slices]
    assert got == [("q_proj", 32, 32), ("k_proj", 16, 16), ("v_proj", 16, 16)]
    assert vocab_shard(251, 1, 2) == vocab_shard(252, 1, 2)  # padded to 252: rows 126..251


def test_one_rank_builds_the_plain_modules_and_packs_them() -> None:
    # The single-rank model is the model as it was: plain nn.Linear / nn.Embedding, every
    # linear pre-packed by the CPU backend; split, the shards are packed too.
    from torch import nn

    whole = LlamaForCausalLM(_config(attention_bias=True))
    layer = whole.layers[0]
    assert type(whole.embed_tokens) is nn.Embedding and type(whole.lm_head) is nn.Linear
    for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
        assert type(linear) is nn.Linear
    assert whole.kv_heads == 4
    assert whole.bind_backend(cpu_backend()) == 4 * 2 + 1
    split = LlamaForCausalLM(_config(attention_bias=True), tp=TensorParallel(1, 2))
    assert split.kv_heads == 2
    assert split.bind_backend(cpu_backend()) == 4 * 2 + 1


@torch.no_grad()
def test_expert_column_shards_sum_to_the_whole_experts_on_both_cpu_paths() -> None:
    # Rank r's experts (gate/up rows and down columns r of 2), run by the torch reference and
    # by the CPU backend's packed experts, add up to the whole experts' output: what
    # the one all-reduce after a sparse layer relies on. Each rank's shards then drop their
    # plain copies as a served rank does, freeing that rank's bytes, with the same output.
    from ferrum_kernels.cpu_linear import release_plain_weights
    from ferrum_kernels.cpu_moe import fused_moe_cpu, prepack_experts
    from ferrum_kernels.moe import ExpertWeights, fused_moe_reference, route

    torch.manual_seed(0)
    e, h, i, world = 4, 64, 96, 2
    whole = ExpertWeights(e, h, i, dtype=torch.float32, device=None)
    whole.gate_up_proj.normal_(std=0.1)
    whole.down_proj.normal_(std=0.1)
    x = torch.randn(7, h)
    weights, ids = route(torch.randn(7, e), 2, normalize=True)
    expected = fused_moe_reference(x, whole, weights, ids)
    parts = {"reference": torch.zeros_like(expected), "packed": torch.zeros_like(expected)}
    for rank in range(world):
        cols = slice(rank * i // world, (rank + 1) * i // world)
        part = ExpertWeights(e, h, i // world, dtype=torch.float32, device=None)
        gate_up = whole.gate_up_stack()  # [E, 2I, H]: gate rows, then up rows
        part.gate_up_stack().copy_(torch.cat([gate_up[:, :i][:, cols], gate_up[:, i:][:, cols]], 1))
        part.down_stack().copy_(whole.down_stack()[:, :, cols])
        parts["reference"] += fused_moe_reference(x, part, weights, ids)
        assert prepack_experts(part) == 2 * e  # the packed path really runs
        packed = fused_moe_cpu(x, part, weights, ids)
        parts["packed"] += packed
        assert release_plain_weights(part) == e * 3 * h * (i // world) * 4  # float32
        assert torch.equal(fused_moe_cpu(x, part, weights, ids), packed)
    for path, total in parts.items():
        assert (total - expected).abs().max().item() <= 1e-5, path


def test_collectives_run_on_gloo_for_cpu_and_nccl_for_gpus() -> None:
    assert collective_backend(torch.device("cpu")) == "gloo"
    assert collective_backend(torch.device("cuda", 1)) == "nccl"
    x = torch.ones(3)
    assert SINGLE_RANK.all_reduce(x) is x and SINGLE_RANK.all_gather(x) is x
    with pytest.raises(ValueError, match="rank must be in"):
        TensorParallel(rank=2, world_size=2)
