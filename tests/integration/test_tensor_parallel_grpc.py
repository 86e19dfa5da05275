"""Every supported architecture split over 2 ranks and served over gRPC (issue #16): float32
logits within 1e-4 of the same model on one rank, 32 identical greedy steps, and the reference
scheduler's tokens equal to transformers'.

Each case starts one executor on one rank (in process) and one with --tensor-parallel-size 2
(rank 0 in process, rank 1 a spawned follower over gloo), and drives both with the same RPCs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from ferrum_client import ExecutorClient, SamplingOptions, pb
from helpers_parallel import parallel_cases, save_case
from helpers_parity import check_scheduler_matches_transformers, random_prompts
from helpers_server import LiveServer, start_live_server

LOGITS = SamplingOptions(full_logits=True)
GREEDY_STEPS = 32
PROMPT = (3, 17, 42, 7, 99, 5, 23, 61, 8, 77, 14, 2, 250, 1, 64)  # every vocabulary >= 251
FIRST_CHUNK = 9  # the prompt runs in two chunks


def _serve(folder: Path, tp: int) -> Iterator[LiveServer]:
    yield from start_live_server(
        model=str(folder),
        block_size=4,
        kv_cache_bytes=2 * 1024**2,
        max_batch_tokens=64,
        max_batch_size=16,
        tensor_parallel_size=tp,
    )


def _greedy_script(target: str) -> tuple[list[np.ndarray], list[int]]:
    """The prompt in two chunks, then GREEDY_STEPS decodes feeding the argmax: the logits of
    every step (float32) and the tokens chosen."""
    rows: list[np.ndarray] = []
    tokens: list[int] = []
    with ExecutorClient(target) as client:
        cache_id, done = "", 0
        for size in (FIRST_CHUNK, len(PROMPT) - FIRST_CHUNK):
            response = client.prefill(
                pb.PrefillRequest(
                    request_id="parity",
                    input_tokens=list(PROMPT),
                    cache_id=cache_id,
                    chunk=pb.PrefillChunk(
                        tokens_processed=done,
                        tokens_to_process=size,
                        total_prompt_tokens=len(PROMPT),
                    ),
                    sampling=LOGITS.to_pb(),
                )
            )
            cache_id, done = response.completed.kv_cache.cache_id, done + size
        last = np.frombuffer(response.completed.output.full_logits, dtype="<f4")
        for step in range(GREEDY_STEPS):
            rows.append(last)
            tokens.append(int(last.argmax()))
            if step == GREEDY_STEPS - 1:
                break
            decoded = client.decode(
                pb.DecodeRequest(
                    cache_id=cache_id,
                    input_token=tokens[-1],
                    position=len(PROMPT) + step,
                    sampling=LOGITS.to_pb(),
                )
            )
            last = np.frombuffer(decoded.completed.output.full_logits, dtype="<f4")
        assert client.release_cache(pb.ReleaseCacheRequest(cache_id=cache_id)).released
    return rows, tokens


@pytest.mark.parametrize("name", list(parallel_cases()))
def test_two_ranks_over_grpc_match_one_rank(name: str, tmp_path: Path) -> None:
    config = parallel_cases()[name]
    hf = save_case(tmp_path / name, config)
    prompts = random_prompts((9, 23, 4, 17), config.vocab_size)
    whole = _serve(tmp_path / name, 1)
    one = next(whole)
    try:
        expected_rows, expected_tokens = _greedy_script(one.target)
    finally:
        whole.close()
    split = _serve(tmp_path / name, 2)
    two = next(split)
    try:
        rows, tokens = _greedy_script(two.target)
        info = check_scheduler_matches_transformers(two, hf, prompts)
        engine = two.engine
        collective_ns = engine.recorder.metrics.collective_seconds._value.get()  # type: ignore[attr-defined]
    finally:
        split.close()
    assert tokens == expected_tokens
    for step, (got, want) in enumerate(zip(rows, expected_rows, strict=True)):
        np.testing.assert_allclose(got, want, atol=1e-4, err_msg=f"{name}, step {step}")
    caps = info.capabilities
    assert caps.tensor_parallel_size == 2 and len(caps.rank_memory_plans) == 2
    assert caps.rank_memory_plans[0].kv_blocks == caps.rank_memory_plans[1].kv_blocks
    assert collective_ns > 0  # rank 0's steps spent time in collectives, and it was counted
