"""A model folder served over gRPC and driven by the reference scheduler, checked against
transformers' greedy tokens: the one scenario every model family's gRPC test runs."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from ferrum_client import AsyncExecutorClient
from ferrum_client.pb import executor_pb2 as pb
from ferrum_client.scheduler import GenerationParams, Scheduler, SchedulerConfig
from helpers_models import hf_greedy
from helpers_server import LiveServer, start_live_server

NEW_TOKENS = 12
# Small steps: prompts arrive in chunks beside other requests' decodes.
SMALL_STEPS = SchedulerConfig(max_step_tokens=16, pipeline_depth=2, align_first_tokens=False)


def serve_folder(folder: str) -> Iterator[LiveServer]:
    """A live server on a model folder, sized for the parity scenario (blocks of 4 tokens)."""
    yield from start_live_server(
        model=folder,
        block_size=4,
        kv_cache_bytes=4 * 1024**2,
        max_batch_tokens=64,
        max_batch_size=16,
    )


def random_prompts(lengths: Sequence[int], vocab: int = 256, seed: int = 5) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def check_scheduler_matches_transformers(
    server: LiveServer, hf: torch.nn.Module, prompts: list[list[int]]
) -> pb.GetInfoResponse:
    """Every request's greedy tokens equal transformers', some step mixed a chunk with decodes,
    and every KV block came back. Returns the server's GetInfo for family-specific checks."""

    async def scenario() -> tuple[list[list[int]], Scheduler, pb.GetInfoResponse]:
        async with AsyncExecutorClient(server.target) as client:
            info = await client.get_info()
            scheduler = Scheduler(client, SMALL_STEPS)
            results = await scheduler.generate(prompts, GenerationParams(max_new_tokens=NEW_TOKENS))
        return [r.output_ids for r in results], scheduler, info

    outputs, scheduler, info = server.run(scenario())  # type: ignore[misc]
    for prompt, got in zip(prompts, outputs, strict=True):
        assert got == hf_greedy(hf, prompt, NEW_TOKENS)
    assert any(r.num_decodes and r.num_prefill_tokens for r in scheduler.stats.records)
    kv: Any = server.engine.kv  # type: ignore[attr-defined]
    kv.check()
    # Windowed layers hold every block as a global model would: all of them come back.
    assert not kv.caches and kv.pool.num_available == kv.pool.num_blocks
    return info
