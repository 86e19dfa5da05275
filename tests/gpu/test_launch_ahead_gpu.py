"""Steps launched ahead on a CUDA device: the same answers as steps run one at a time, and a
launch behind a step in flight never waits for the device (no stream synchronize).

Run with ``pytest tests/gpu -m gpu`` in its own process (see test_gpu_kernels.py for why).
"""

from __future__ import annotations

import pytest
import torch
from helpers_gpu import require_cuda_and_triton

pytestmark = pytest.mark.gpu

require_cuda_and_triton()

from ferrum_server.config import EngineConfig  # noqa: E402
from ferrum_server.domain import ItemStatus  # noqa: E402
from ferrum_server.engine import Engine  # noqa: E402
from ferrum_server.models import tiny_config  # noqa: E402
from helpers_launch import (  # noqa: E402
    BLOCK,
    Decoding,
    make_requests,
    run_ahead,
    run_sequential,
)


def _engine(graphs: bool) -> Engine:
    return Engine(
        EngineConfig(
            device="cuda",
            block_size=BLOCK,
            kv_cache_bytes=256 * tiny_config().kv_bytes_per_token(torch.float32) * BLOCK,
            max_batch_size=16,
            max_batch_tokens=64,
            cuda_graphs=graphs,
            cuda_graph_max_batch=8,
        )
    )


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_steps_launched_ahead_match_steps_run_one_at_a_time(graphs: bool) -> None:
    answers = []
    for ahead in (False, True):
        engine = _engine(graphs)
        try:
            requests = make_requests(9)
            answers.append(
                run_ahead(engine, requests, 24, [])
                if ahead
                else run_sequential(engine, requests, 24)
            )
            assert not graphs or engine.stats.graph_steps > 0
        finally:
            engine.shutdown()
    assert answers[0] == answers[1]


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_a_launch_behind_a_step_in_flight_never_waits_for_the_device(graphs: bool) -> None:
    engine = _engine(graphs)
    try:
        decoding = Decoding(engine, [[(7 * r + i) % 500 for i in range(5 + r)] for r in range(4)])
        for offset in range(3):  # compile and warm every kernel of these shapes first
            engine.execute(decoding.step(offset))
        first = engine.launch(decoding.step(3))
        torch.cuda.set_sync_debug_mode("error")
        try:
            second = engine.launch(decoding.step(4))  # reads `first`'s tokens on the device
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for launched in (first, second):
            results = engine.finish(launched).results
            assert all(r.status == ItemStatus.TOKEN for r in results)
        engine.kv.check()
    finally:
        engine.shutdown()
