"""A small scheduler loop driven through the client: chunked prefill mixed with decodes in
unified batches over the step stream. Used by `ferrum-executor demo` and the subprocess test."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from ferrum_client import AsyncExecutorClient, BatchBuilder, item_views, pb


@dataclass
class DemoRequest:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    cache_id: str = ""
    prefilled: int = 0
    output: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


async def run_demo(
    target: str,
    *,
    num_requests: int = 4,
    max_new_tokens: int = 16,
    chunk_tokens: int = 24,
    seed: int = 0,
) -> dict[str, object]:
    """Generate greedily for a few random prompts; return outputs and timings."""
    rng = random.Random(seed)
    async with AsyncExecutorClient(target) as client:
        info = await client.get_info()
        vocab = info.model_info.vocab_size
        requests = [
            DemoRequest(
                f"demo-{i}",
                [rng.randrange(vocab) for _ in range(rng.randint(8, 48))],
                max_new_tokens,
            )
            for i in range(num_requests)
        ]
        started = time.perf_counter()
        steps = 0
        async with client.step_stream() as stream:
            while not all(r.done for r in requests):
                batch = BatchBuilder()
                active: list[DemoRequest] = []
                for r in requests:
                    if r.done:
                        continue
                    if r.prefilled < len(r.prompt):
                        chunk = r.prompt[r.prefilled : r.prefilled + chunk_tokens]
                        batch.add_prefill_chunk(
                            r.request_id, r.cache_id, chunk, r.prefilled, len(r.prompt)
                        )
                    else:
                        batch.add_decode(
                            r.request_id,
                            r.cache_id,
                            r.output[-1],
                            len(r.prompt) + len(r.output) - 1,
                        )
                    active.append(r)
                response = await stream.run(pb.UnifiedBatchRequest(items=batch.build()))
                steps += 1
                for r, view in zip(active, item_views(response.results), strict=True):
                    if view.deferred:
                        continue
                    r.cache_id = view.cache_id
                    r.prefilled = min(len(r.prompt), view.committed_tokens)
                    if view.has_token:
                        r.output.append(view.token_id)
        elapsed = time.perf_counter() - started
        for r in requests:
            await client.complete_cache(
                pb.CompleteCacheRequest(
                    request_id=r.request_id,
                    cache_id=r.cache_id,
                    input_tokens=len(r.prompt),
                    output_tokens=len(r.output),
                )
            )
        capacity = (await client.get_kv_slot_capacity()).snapshot
    generated = sum(len(r.output) for r in requests)
    return {
        "model": info.model_info.model_id,
        "requests": {r.request_id: r.output for r in requests},
        "steps": steps,
        "generated_tokens": generated,
        "seconds": round(elapsed, 3),
        "tokens_per_second": round(generated / elapsed, 1),
        "free_blocks_after": capacity.free_blocks + capacity.cached_blocks,
        "total_blocks": capacity.total_blocks,
    }
