"""The GPU benchmark's CPU dry run: every section's code path, a tiny model, a few seconds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers_scripts import load_script

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_bench.py"


def _load_bench() -> Any:
    return load_script("ferrum_gpu_bench", _BENCH)


def test_dry_run_writes_every_section(tmp_path: Path) -> None:
    bench = _load_bench()
    out = tmp_path / "bench.json"
    assert bench.main(["--dry-run", "--requests", "6", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["dry_run"] is True
    assert report["backend"] == "cpu"
    assert report["rates"]["copy_bandwidth_gbps"] > 0
    assert [row["batch"] for row in report["decode"]] == [1, 4]
    assert all(row["step_ms"] > 0 and row["weight_floor_ms"] > 0 for row in report["decode"])
    assert report["prefill"]["tokens"] == 32 and report["prefill"]["tokens_per_s"] > 0
    assert {row["kernel"].split()[0] for row in report["kernels"]} == {
        "decode_attention",
        "sample",
    }
    engine = report["engine"]
    assert engine["requests"] == 6 and engine["output_tokens"] == 6 * 4
    assert engine["output_tokens_per_s"] > 0
    kinds = engine["steps_by_kind"]
    assert kinds["with_prefill"]["steps"] + kinds["decode_only"]["steps"] == engine["steps"]
    assert 0 < engine["execute_seconds"] <= engine["seconds"]
    # The same requests launched ahead: every output, the same tokens (float32 on CPU: a row's
    # result does not depend on the rows batched with it).
    ahead = engine["launch_ahead"]
    assert ahead["requests"] == 6 and ahead["output_tokens"] == 6 * 4
    assert ahead["output_tokens_per_s"] > 0 and ahead["speedup"] > 0
    assert ahead["identical_outputs"] == 1.0
    assert all(row["graph_replay_ms"] > 0 for row in report["decode"])
    # Kernel-level profiles: eager and graph at the smallest and largest batch, and a few
    # steady-state engine decode steps (on CPU only the host side is recorded).
    assert set(report["profile"]) == {
        "decode_b1_eager", "decode_b1_graph", "decode_b4_eager", "decode_b4_graph"
    }  # fmt: skip
    for prof in [*report["profile"].values(), engine["profile_decode_steps"]]:
        assert prof["wall_ms_per_step"] > 0
        assert prof["top_host"] and prof["top_host"][0]["us_per_step"] > 0
        assert prof["device_busy_ms_per_step"] == 0  # no CUDA activity on CPU
    assert all(prof["steps"] == 5 for prof in report["profile"].values())
    # Up to 5 engine steps: this small run may end inside the window.
    engine_profile = engine["profile_decode_steps"]
    assert 1 <= engine_profile["steps"] == len(engine_profile["batch_sizes"]) <= 5


def test_flop_model_counts_linear_layers() -> None:
    bench = _load_bench()
    config = bench.llama3_8b_config()
    flops = bench.matmul_flops(config, [(0, 1)])
    # One token through an 8B model: ~2 * 7e9 linear FLOPs (+ LM head), attention negligible.
    assert 1.3e10 < flops < 1.7e10


def test_tensor_parallel_dry_run_labels_every_row_with_its_size(tmp_path: Path) -> None:
    """`--tensor-parallel-size 2 --dry-run`: two gloo rank processes the script starts itself
    run the split model's decode and prefill steps beside TP=1; every row says its TP size,
    and only the split rows carry the collectives' time and the speed-up."""
    bench = _load_bench()
    out = tmp_path / "bench.json"
    assert bench.main(["--dry-run", "--tensor-parallel-size", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["tensor_parallel_size"] == 2
    split = report["tensor_parallel"]
    assert split["size"] == 2
    assert [(r["tp"], r["batch"]) for r in split["decode"]] == [(1, 1), (2, 1), (1, 4), (2, 4)]
    assert [(r["tp"], r["tokens"]) for r in split["prefill"]] == [(1, 32), (2, 32)]
    for row in split["decode"] + split["prefill"]:
        assert row["step_ms"] > 0 and row["tokens_per_s"] > 0
        labelled = {"collectives_ms", "collectives_share", "speedup_vs_tp1"}
        assert (labelled <= set(row)) is (row["tp"] == 2), row
    assert "engine" not in report and "kernels" not in report  # single-device sections


def test_tensor_parallel_needs_that_many_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Fewer visible GPUs than --tensor-parallel-size: one clear line, exit 2, nothing run."""
    import torch

    bench = _load_bench()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    out = tmp_path / "bench.json"
    assert bench.main(["--tensor-parallel-size", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "--tensor-parallel-size 2 needs 2 GPUs, but torch sees 1 (CUDA_VISIBLE_DEVICES=0); "
        "nothing was run"
    )
    assert not out.exists()
    assert bench.main(["--dry-run", "--tensor-parallel-size", "0", "--out", str(out)]) == 2
    assert not out.exists()


def test_a_failing_section_is_recorded_and_the_rest_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device lease may allow one try: a section that raises leaves its traceback in the
    report, the later sections still run, and the exit code says something failed."""
    bench = _load_bench()

    def broken(plan: object) -> None:
        raise RuntimeError("kernel launch failed")

    monkeypatch.setattr(bench, "bench_kernels", broken)
    out = tmp_path / "bench.json"
    assert bench.main(["--dry-run", "--requests", "4", "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert list(report["errors"]) == ["kernels"]
    assert "RuntimeError: kernel launch failed" in report["errors"]["kernels"]
    assert "kernels" not in report
    assert report["decode"] and report["prefill"]["tokens"] == 32
    assert report["engine"]["requests"] == 4
    assert set(report["section_seconds"]) == {
        "rates",
        "kernels",
        "split_sweep",
        "model",
        "cuda_graphs",
        "decode",
        "profile",
        "prefill",
        "engine",
    }


def test_the_report_is_written_after_every_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run killed mid-way (a lease's time limit) keeps what the finished sections measured."""
    bench = _load_bench()
    out = tmp_path / "bench.json"
    seen: list[set[str]] = []
    real_prefill = bench.bench_prefill

    def prefill_then_look(*args: object) -> object:
        seen.append(set(json.loads(out.read_text())))
        return real_prefill(*args)

    monkeypatch.setattr(bench, "bench_prefill", prefill_then_look)
    assert bench.main(["--dry-run", "--requests", "4", "--out", str(out)]) == 0
    assert {"rates", "kernels", "decode"} <= seen[0] and "prefill" not in seen[0]


def test_no_profile_skips_every_profiler(tmp_path: Path) -> None:
    bench = _load_bench()
    out = tmp_path / "bench.json"
    assert bench.main(["--dry-run", "--requests", "4", "--no-profile", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "profile" not in report and "profile" not in report["section_seconds"]
    assert report["engine"]["profile_decode_steps"] == {}


def test_split_sweep_times_every_count_that_leaves_each_split_four_blocks() -> None:
    """Off CUDA the sweep is empty; with an attention function it times the heuristic and each
    forced count whose splits still hold four blocks, and names the fastest."""
    import argparse

    from ferrum_kernels.attention import paged_attention

    bench = _load_bench()
    plan = bench.dry_plan(argparse.Namespace(requests=4))
    assert bench.bench_split_sweep(plan) == []
    seen: list[int | None] = []

    def attend(q: Any, kv: Any, meta: Any, scale: float, n: int | None) -> Any:
        seen.append(n)
        return paged_attention(q, kv, meta, scale)

    (row,) = bench.bench_split_sweep(plan, attend)  # one case: 2 items of 40 tokens, blocks of 4
    assert row["case"] == "b=2 ctx=40"
    assert set(seen) == {None, 1, 2}  # 40 // 4 < 16 tokens a split: no more than 2
    assert {k for k in row if k.startswith("s")} == {"s1_us", "s2_us"}
    assert row["best_splits"] in (1, 2) and row["best_kv_gbps"] > 0 and row["heuristic_us"] > 0


def test_engine_steps_run_on_the_engine_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a server runs them: every step and release on the engine's own thread."""
    import threading

    from ferrum_server import engine as engine_module

    threads: dict[str, set[str]] = {}

    def on_thread(name: str) -> None:
        real = getattr(engine_module.Engine, name)

        def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
            threads.setdefault(name, set()).add(threading.current_thread().name)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(engine_module.Engine, name, recorded)

    for name in ("execute", "release", "launch", "finish"):
        on_thread(name)
    bench = _load_bench()
    out = tmp_path / "bench.json"
    assert bench.main(["--dry-run", "--requests", "4", "--no-profile", "--out", str(out)]) == 0
    # Both drivers: steps one at a time (execute) and launched ahead (launch, finish).
    assert set(threads) == {"execute", "release", "launch", "finish"}
    names = set().union(*threads.values())
    assert all(name.startswith("ferrum-engine") for name in names), threads


def test_a_device_fault_that_breaks_the_cleanup_still_leaves_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After an illegal address every CUDA call raises, the cache release in the failure path
    included (the first H200 run lost its report that way)."""
    import torch

    bench = _load_bench()

    def faulted(*args: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(bench, "bench_kernels", faulted)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", faulted)
    out = tmp_path / "bench.json"
    assert bench.main(["--dry-run", "--requests", "4", "--no-profile", "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert list(report["errors"]) == ["kernels"] and report["engine"]["requests"] == 4


def test_launched_ahead_admission_waits_for_a_sequence_slot(tmp_path: Path) -> None:
    """Launched ahead, a finished request's cache is released a step later than one at a
    time: with more requests than sequence slots, admission must wait for a slot (an opener
    the engine defers has no cache for its decodes to continue)."""
    bench = _load_bench()
    out = tmp_path / "bench.json"
    assert bench.main(["--dry-run", "--requests", "12", "--no-profile", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "errors" not in report
    ahead = report["engine"]["launch_ahead"]
    assert ahead["output_tokens"] == 12 * 4 and ahead["identical_outputs"] == 1.0
