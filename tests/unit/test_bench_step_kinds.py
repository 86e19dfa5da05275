"""The bench report's split of the engine's time by step kind (prompt, mixed, decode, empty), and
each kind's share of the matmul ceiling (harness.steps_by_kind, _ceiling_by_kind)."""

from __future__ import annotations

from typing import Any

import pytest
from ferrum_server.tools.bench import harness
from ferrum_server.tools.bench.runners import RequestTrace, RunOutput
from ferrum_server.tools.bench.workloads import WORKLOADS, matmul_flops


def _record(decodes: int, prefill: int, engine_ms: float, keys: int = 0) -> dict[str, Any]:
    return {
        "decodes": decodes,
        "prefill_tokens": prefill,
        "decode_keys": keys,
        "engine_ms": engine_ms,
        "forward_ms": engine_ms - 1.0,
        "sample_ms": 0.5,
    }


RECORDS = [
    _record(0, 100, 10.0),
    _record(4, 0, 2.0, keys=40),  # kinds need not come in order
    _record(0, 50, 6.0),
    _record(2, 10, 4.0, keys=7),
    _record(4, 0, 3.0, keys=44),
    _record(4, 0, 4.0, keys=48),
    _record(0, 0, 1.0),  # every item deferred: nothing ran
]


def _summary() -> dict[str, Any]:
    run = RunOutput("ferrum-grpc", 0.05, [RequestTrace(0.0, [0.01, 0.02], [1, 2])], steps=RECORDS)
    return harness.summarize(run, [[1, 2, 3]])


def test_steps_split_by_kind() -> None:
    assert harness.step_kind(_record(0, 3, 1.0)) == "prompt"
    assert harness.step_kind(_record(3, 0, 1.0)) == "decode"
    assert harness.step_kind(_record(1, 1, 1.0)) == "mixed"
    assert harness.step_kind(_record(0, 0, 1.0)) == "empty"
    by_kind = _summary()["steps"]["by_kind"]
    assert list(by_kind) == ["prompt", "mixed", "decode", "empty"]
    assert by_kind["empty"]["count"] == 1 and by_kind["empty"]["engine_s"] == 0.001
    assert by_kind["prompt"] == {
        "count": 2,
        "engine_s": 0.016,
        "forward_s": 0.015,  # (9 + 0.5) + (5 + 0.5) ms
        "step_ms_p50": 8.0,
        "prefill_tokens": 150,
        "decodes": 0,
        "decode_keys": 0,
    }
    assert by_kind["mixed"]["count"] == 1 and by_kind["mixed"]["decodes"] == 2
    assert by_kind["decode"]["engine_s"] == 0.009
    assert by_kind["decode"]["step_ms_p50"] == 3.0
    assert by_kind["decode"]["decode_keys"] == 132 and by_kind["mixed"]["decode_keys"] == 7
    # A report written before decode_keys existed still splits.
    old = [{k: v for k, v in r.items() if k != "decode_keys"} for r in RECORDS]
    assert harness.steps_by_kind(old)["decode"]["decode_keys"] == 0
    assert harness.steps_by_kind([]) == {}


def test_each_kind_is_charged_its_rows_at_the_best_gemm_rate() -> None:
    summary = _summary()
    flops = {"matmul": 1e9, "linear_per_row": 1e9, "lm_head_per_row": 5e8}
    derived = harness._derived(
        {"ferrum-grpc": RunOutput("ferrum-grpc", 0.05, [])},
        {"ferrum-grpc": summary},
        flops,
        {"packed": 10_000.0},
    )
    shares = derived["matmul_ceiling"]["by_step_kind"]
    # prompt: 150 rows' linears over 0.016 s at 10 TFLOP/s; mixed: 12 rows and 2 LM head rows
    # over 0.004 s; decode: 12 rows and their 12 LM head rows over 0.009 s.
    assert shares["prompt"] == pytest.approx(150e9 / 1e13 / 0.016, abs=1e-3)
    assert shares["mixed"] == pytest.approx(13e9 / 1e13 / 0.004, abs=1e-3)
    assert shares["decode"] == pytest.approx(18e9 / 1e13 / 0.009, abs=1e-3)
    assert shares["empty"] == 0.0  # no work, some time
    report = {
        "workload": "w1",
        "requests": 1,
        "prompt_tokens": 3,
        "max_new_tokens": 2,
        "mode": "offline",
        "by_dtype": {
            "bfloat16": {
                "gemm_gflops": {"packed": 10_000.0},
                "results": {"ferrum-grpc": summary},
                "skipped": {},
                "derived": derived,
            }
        },
    }
    text = harness.format_table(report)
    # Shares to one decimal: the targets (75%, 80%) sit within a point of the results.
    assert "GFLOP/s; reached 0.2%" in text  # 1 GFLOP at 10 TFLOP/s over the 0.05 s wall
    assert "prompt 2 steps 0.02 s (p50 8.0 ms, 93.8% of the ceiling)" in text
    assert "mixed 1 step 0.00 s (p50 4.0 ms, 32.5% of the ceiling)" in text
    # idle: the 0.05 s wall less the steps' 0.030 s
    assert "decode 3 steps 0.01 s (p50 3.0 ms, 20.0% of the ceiling); empty 1 step" in text
    assert text.rstrip().endswith("idle 0.02 s")


def test_the_per_row_work_adds_up_to_the_workload_totals() -> None:
    w1 = WORKLOADS["w1"]
    prompts = w1.prompts()
    flops = matmul_flops(w1, prompts)
    rows = sum(len(p) for p in prompts) + len(prompts) * (w1.max_new_tokens - 1)
    assert flops["linear"] == flops["linear_per_row"] * rows
    assert flops["lm_head"] == flops["lm_head_per_row"] * len(prompts) * w1.max_new_tokens


def test_decode_steps_are_set_against_their_memory_floor() -> None:
    """Each decode step reads every weight once and its decodes' K/V: the floor at the probe's
    read rate, against the decode steps' engine time; only where that count holds."""
    w1 = WORKLOADS["w1"]
    flops = matmul_flops(w1, w1.prompts())
    floor = harness.memory_floor_inputs(w1, "bfloat16", flops, 20.0)
    assert floor is not None
    c = w1.model
    params = (
        sum(
            c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim  # qkv
            + c.num_heads * c.head_dim * c.hidden_size  # o
            + 3 * c.hidden_size * c.intermediate_size  # gate, up, down
            for _ in range(c.num_layers)
        )
        + c.vocab_size * c.hidden_size
    )  # the LM head
    assert floor["weight_bytes"] == 2 * params  # bfloat16
    assert floor["kv_bytes_per_key"] == c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2
    float32 = harness.memory_floor_inputs(w1, "float32", flops, 20.0)
    assert float32 is not None and float32["weight_bytes"] == 4 * params
    # A shared prompt's keys are read once a step, a mixture's experts as its tokens pick
    # them, and without a probe there is no rate: no floor.
    for name in ("w2-prefix", "w1-moe"):
        other = WORKLOADS[name]
        assert (
            harness.memory_floor_inputs(
                other, "bfloat16", matmul_flops(other, other.prompts()), 20.0
            )
            is None
        )
    assert harness.memory_floor_inputs(w1, "bfloat16", flops, 0.0) is None
    made_up = {"read_gbs": 10.0, "weight_bytes": 1e6, "kv_bytes_per_key": 1e3}
    derived = harness._derived(
        {"ferrum-grpc": RunOutput("ferrum-grpc", 0.05, [])},
        {"ferrum-grpc": _summary()},
        {"matmul": 1e9, "linear_per_row": 1e9, "lm_head_per_row": 5e8},
        {"packed": 10_000.0},
        made_up,
    )
    # decode: 3 steps' weights (3 MB) and 132 keys (0.132 MB) at 10 GB/s over 0.009 s.
    share = derived["memory_floor"]["by_step_kind"]["decode"]
    assert share == pytest.approx(3.132e6 / 10e9 / 0.009, abs=1e-3)
    assert set(derived["memory_floor"]["by_step_kind"]) == {"decode"}
    report = {
        "workload": "w1", "requests": 1, "prompt_tokens": 3, "max_new_tokens": 2,
        "mode": "offline",
        "by_dtype": {"bfloat16": {"gemm_gflops": {"packed": 10_000.0},
                                  "results": {"ferrum-grpc": _summary()}, "skipped": {},
                                  "derived": derived}},
    }  # fmt: skip
    text = harness.format_table(report)
    assert "(p50 3.0 ms, 20.0% of the ceiling, 3.5% of the memory floor)" in text
