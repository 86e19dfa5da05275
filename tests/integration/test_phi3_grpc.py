"""A Phi-3 (fused checkpoint tensors, window 6 on every layer, LongRoPE with an original length
of 16) served over gRPC and driven by the reference scheduler: chunked prefills crossing the
window edge share steps with decodes far past it, and every request's greedy tokens equal
transformers' on the same weights. Every prompt is longer than the original length, where
transformers uses LongRoPE's long factors, as a server admitting the model's full 256 positions
does for every sequence."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ferrum_client import AsyncExecutorClient
from ferrum_client.scheduler import GenerationParams, Scheduler, SchedulerConfig
from helpers_models import hf_greedy, longrope_scaling, save_phi3
from helpers_server import LiveServer, start_live_server

WINDOW = 6
ORIGINAL = 16
VOCAB = 256
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    folder = tmp_path_factory.mktemp("phi3_grpc")
    hf = save_phi3(
        folder,
        VOCAB,
        sliding_window=WINDOW,
        original_max_position_embeddings=ORIGINAL,
        rope_scaling=longrope_scaling(32),
    )
    return hf, folder


@pytest.fixture(scope="module")
def server(hf_model: tuple[torch.nn.Module, Path]) -> Iterator[LiveServer]:
    yield from start_live_server(
        model=str(hf_model[1]),
        block_size=4,
        kv_cache_bytes=4 * 1024**2,
        max_batch_tokens=64,
        max_batch_size=16,
    )


@torch.no_grad()
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_scheduler_over_grpc_matches_transformers(
    server: LiveServer, hf_model: tuple[torch.nn.Module, Path]
) -> None:
    gen = torch.Generator().manual_seed(5)
    prompts = [
        torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (17, 23, 40, 31, 19, 26)
    ]
    # Small steps: prompts arrive in chunks beside other requests' decodes.
    config = SchedulerConfig(max_step_tokens=16, pipeline_depth=2, align_first_tokens=False)

    async def scenario() -> tuple[list[list[int]], Scheduler]:
        async with AsyncExecutorClient(server.target) as client:
            scheduler = Scheduler(client, config)
            results = await scheduler.generate(prompts, GenerationParams(max_new_tokens=NEW_TOKENS))
        return [r.output_ids for r in results], scheduler

    outputs, scheduler = server.run(scenario())  # type: ignore[misc]
    for prompt, got in zip(prompts, outputs, strict=True):
        assert got == hf_greedy(hf_model[0], prompt, NEW_TOKENS)
    assert any(r.num_decodes and r.num_prefill_tokens for r in scheduler.stats.records)
    engine = server.engine
    config_ = engine.model_config  # type: ignore[attr-defined]
    assert config_.model_type == "phi3" and config_.sliding_windows == (WINDOW, WINDOW)
    kv = engine.kv  # type: ignore[attr-defined]
    kv.check()
    assert not kv.caches and kv.pool.num_available == kv.pool.num_blocks
