"""Mixtral (window 6) and Qwen3-MoE served over gRPC and driven by the reference scheduler:
chunked prefills share steps with other requests' decodes, so each step's experts see a
different mix of tokens, and every request's greedy tokens equal transformers' on the same
weights. GetInfo reports the experts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ferrum_client import AsyncExecutorClient
from ferrum_client.pb import executor_pb2 as pb
from ferrum_client.scheduler import GenerationParams, Scheduler, SchedulerConfig
from helpers_models import hf_greedy
from helpers_moe import mixtral_config, qwen3_moe_config, save_moe
from helpers_server import LiveServer, start_live_server

NEW_TOKENS = 12
FAMILIES = {"mixtral": mixtral_config, "qwen3_moe": qwen3_moe_config}


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[torch.nn.Module, LiveServer]]:
    folder: Path = tmp_path_factory.mktemp(f"{request.param}_grpc")
    hf = save_moe(folder, FAMILIES[request.param]())
    for server in start_live_server(
        model=str(folder),
        block_size=4,
        kv_cache_bytes=4 * 1024**2,
        max_batch_tokens=64,
        max_batch_size=16,
    ):
        yield hf, server


@torch.no_grad()
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_scheduler_over_grpc_matches_transformers(
    served: tuple[torch.nn.Module, LiveServer],
) -> None:
    hf, server = served
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 23, 4, 31, 14)]
    config = SchedulerConfig(max_step_tokens=16, pipeline_depth=2, align_first_tokens=False)

    async def scenario() -> tuple[list[list[int]], Scheduler, pb.GetInfoResponse]:
        async with AsyncExecutorClient(server.target) as client:
            info = await client.get_info()
            scheduler = Scheduler(client, config)
            results = await scheduler.generate(prompts, GenerationParams(max_new_tokens=NEW_TOKENS))
        return [r.output_ids for r in results], scheduler, info

    outputs, scheduler, info = server.run(scenario())  # type: ignore[misc]
    for prompt, got in zip(prompts, outputs, strict=True):
        assert got == hf_greedy(hf, prompt, NEW_TOKENS)
    assert any(r.num_decodes and r.num_prefill_tokens for r in scheduler.stats.records)
    model = info.model_info
    assert model.num_experts == hf.config.num_local_experts
    assert model.num_experts_per_token == hf.config.num_experts_per_tok
    assert model.num_parameters == hf.num_parameters()
    kv = server.engine.kv  # type: ignore[attr-defined]
    kv.check()
    assert not kv.caches and kv.pool.num_available == kv.pool.num_blocks
