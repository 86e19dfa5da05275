"""`ferrum-executor demo`: a small scheduler loop driven through the client, chunked prefill
mixed with decodes in unified batches over the step stream, against a local server subprocess.
`run_demo` is also used by the subprocess test."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from dataclasses import dataclass, field

from ferrum_client import AsyncExecutorClient, BatchBuilder, item_views, pb

from ferrum_server.config import DTYPES
from ferrum_server.server_process import start_server_process


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


def add_demo_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)


def cmd_demo(args: argparse.Namespace) -> int:
    process, port = start_server_process(
        [
            "--model",
            args.model,
            "--dtype",
            args.dtype,
            "--metrics-port",
            "-1",
            "--log-level",
            "warning",
        ]
    )
    try:
        report = asyncio.run(
            run_demo(
                f"127.0.0.1:{port}", num_requests=args.requests, max_new_tokens=args.max_new_tokens
            )
        )
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    sys.stdout.write(json.dumps(report, indent=2) + "\n")
    return 0 if report["free_blocks_after"] == report["total_blocks"] else 1
