"""The start-up memory arithmetic, with made-up device sizes (no GPU needed)."""

from __future__ import annotations

import pytest
from ferrum_server.memory_plan import MemoryPlan, estimate_graph_bytes, plan_memory

GIB = 1024**3
MIB = 1024**2


def _plan(**overrides: object) -> MemoryPlan:
    args: dict[str, object] = {
        "total_bytes": 80 * GIB,
        "utilization": 0.9,
        "weights_bytes": 16 * GIB,
        "activation_peak_bytes": 2 * GIB,
        "cuda_graph_bytes": 512 * MIB,
        "block_bytes": 2 * MIB,
        "requested_kv_bytes": 0,
    }
    args.update(overrides)
    return plan_memory(**args)  # type: ignore[arg-type]


def test_kv_gets_what_the_budget_leaves() -> None:
    plan = _plan()
    left = int(80 * GIB * 0.9) - 16 * GIB - 2 * GIB - 512 * MIB
    assert plan.num_blocks == left // (2 * MIB)
    assert plan.kv_cache_bytes == plan.num_blocks * 2 * MIB
    assert plan.budget_bytes == int(80 * GIB * 0.9)
    assert plan.planned_bytes <= plan.budget_bytes
    assert plan.budget_bytes - plan.planned_bytes < 2 * MIB  # only the rounding to whole blocks
    assert not plan.explicit_kv
    assert plan.cuda_graph_reserved_bytes == 512 * MIB and plan.cuda_graph_bytes == 0


def test_reserved_blocks_come_out_of_the_pool() -> None:
    plain, reserved = _plan(), _plan(reserved_blocks=1)
    assert reserved.num_blocks == plain.num_blocks - 1
    assert reserved.kv_cache_bytes == plain.kv_cache_bytes  # same memory, one block internal
    assert reserved.reserved_blocks == 1


def test_free_memory_caps_the_pool() -> None:
    # Another process holds memory: only 30 GiB are free after the weights.
    plan = _plan(free_bytes=30 * GIB)
    assert plan.kv_cache_bytes <= 30 * GIB - 2 * GIB - 512 * MIB
    assert plan.kv_cache_bytes > 27 * GIB


def test_explicit_size_wins_when_it_fits() -> None:
    plan = _plan(requested_kv_bytes=10 * GIB + 1)
    assert plan.explicit_kv
    assert plan.num_blocks == (10 * GIB + 1) // (2 * MIB)


def test_explicit_size_that_does_not_fit_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match=r"--kv-cache-bytes .* exceeds the .* left of 90% of 80.00 GiB after weights",
    ) as info:
        _plan(requested_kv_bytes=60 * GIB)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"exceeds the .* free on the device"):
        _plan(requested_kv_bytes=20 * GIB, free_bytes=10 * GIB)


def test_nothing_left_for_kv_is_one_clear_line() -> None:
    with pytest.raises(ValueError, match="exceed 90% of the device") as info:
        _plan(weights_bytes=75 * GIB)
    message = str(info.value)
    assert "\n" not in message and "--gpu-memory-utilization" in message
    with pytest.raises(ValueError, match="holds no usable block"):
        _plan(block_bytes=64 * GIB)
    with pytest.raises(ValueError, match="holds no usable block"):
        _plan(requested_kv_bytes=2 * MIB, reserved_blocks=1)


def test_cpu_style_plan_keeps_the_default_pool() -> None:
    block = 2048
    plan = plan_memory(
        total_bytes=16 * GIB,
        utilization=1.0,
        weights_bytes=700_000,
        activation_peak_bytes=0,
        cuda_graph_bytes=0,
        block_bytes=block,
        requested_kv_bytes=256 * MIB,
    )
    assert plan.num_blocks == 256 * MIB // block and plan.kv_cache_bytes == 256 * MIB
    with pytest.raises(ValueError, match="exceeds"):
        plan_memory(
            total_bytes=GIB,
            utilization=1.0,
            weights_bytes=0,
            activation_peak_bytes=0,
            cuda_graph_bytes=0,
            block_bytes=block,
            requested_kv_bytes=2 * GIB,
        )


def test_measured_graphs_are_checked_against_the_reservation() -> None:
    plan = _plan()
    within = plan.with_cuda_graph_bytes(400 * MIB)
    assert within.graphs_within_reservation and within.planned_bytes == plan.planned_bytes
    over = plan.with_cuda_graph_bytes(700 * MIB)
    assert not over.graphs_within_reservation
    assert over.planned_bytes == plan.planned_bytes + 188 * MIB
    parts = over.parts()
    assert parts["cuda_graphs"] == 700 * MIB and parts["cuda_graphs_reserved"] == 512 * MIB
    assert parts["kv_cache"] == plan.kv_cache_bytes and parts["budget"] == plan.budget_bytes


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="utilisation"):
        _plan(utilization=0.0)
    with pytest.raises(ValueError, match="at least one byte"):
        _plan(block_bytes=0)


def test_graph_estimate_extrapolates_from_two_captures() -> None:
    margin = 64 * MIB  # or a tenth of the largest graph, whichever is more
    assert estimate_graph_bytes(300 * MIB, 8 * MIB, 20) == 300 * MIB + 19 * 8 * MIB + margin
    # Increments hidden by the allocation granularity still count a floor per graph.
    assert estimate_graph_bytes(300 * MIB, 0, 3) == 300 * MIB + 2 * 2 * MIB + margin
    assert estimate_graph_bytes(300 * MIB, 0, 1) == 300 * MIB + margin
    assert estimate_graph_bytes(2 * GIB, 0, 1) == 2 * GIB + 2 * GIB // 10
    assert estimate_graph_bytes(0, 0, 0) == 0
