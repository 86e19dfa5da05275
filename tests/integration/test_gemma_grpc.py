"""Gemma 2 and Gemma 3 served over gRPC and driven by the reference scheduler: chunked
prefills crossing the sliding-window edge share steps with decodes far past it, and every
request's greedy tokens equal transformers' on the same weights."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from ferrum_client import AsyncExecutorClient
from ferrum_client.scheduler import GenerationParams, Scheduler, SchedulerConfig
from helpers_models import GEMMA_FAMILIES, GEMMA_WINDOW, hf_greedy, save_gemma
from helpers_server import LiveServer, start_live_server

VOCAB = 256
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=GEMMA_FAMILIES)
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[torch.nn.Module, LiveServer]]:
    folder = tmp_path_factory.mktemp(f"{request.param}_grpc")
    hf = save_gemma(folder, request.param, VOCAB)
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
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 23, 4, 17)]
    # Small steps: prompts arrive in chunks beside other requests' decodes.
    config = SchedulerConfig(max_step_tokens=16, pipeline_depth=2, align_first_tokens=False)

    async def scenario() -> tuple[list[list[int]], Scheduler]:
        async with AsyncExecutorClient(server.target) as client:
            scheduler = Scheduler(client, config)
            results = await scheduler.generate(prompts, GenerationParams(max_new_tokens=NEW_TOKENS))
        return [r.output_ids for r in results], scheduler

    outputs, scheduler = server.run(scenario())  # type: ignore[misc]
    for prompt, got in zip(prompts, outputs, strict=True):
        assert got == hf_greedy(hf, prompt, NEW_TOKENS)
    assert any(r.num_decodes and r.num_prefill_tokens for r in scheduler.stats.records)
    engine = server.engine
    assert GEMMA_WINDOW in engine.model_config.sliding_windows  # type: ignore[attr-defined]
    kv = engine.kv  # type: ignore[attr-defined]
    kv.check()
    assert not kv.caches and kv.pool.num_available == kv.pool.num_blocks
