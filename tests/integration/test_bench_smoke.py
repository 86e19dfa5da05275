"""`ferrum-executor bench --workload smoke` and `ferrum-executor generate` end to end, as CI runs
them (subprocesses, a server started by the command itself)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from ferrum_client.scheduler import SchedulerConfig
from ferrum_server.tools.bench.harness import percentile, summarize
from ferrum_server.tools.bench.runners import RequestTrace, RunOutput, RunSpec
from ferrum_server.tools.bench.workloads import WORKLOADS, matmul_flops


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    # The native decode kernel is tested (and built, once) in test_cpu_fast_paths; here the
    # smoke model would otherwise pay that one-off build inside its time budget.
    env = {**os.environ, "FERRUM_CPU_NATIVE": "0"}
    return subprocess.run(
        [sys.executable, "-m", "ferrum_server", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )


def _smoke_bench(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess[str], Any]:
    """`bench --workload smoke --dtype float32` with `flags`, as CI runs it; its JSON report."""
    out = tmp_path / "bench.json"
    done = _cli(
        "bench",
        "--workload", "smoke",
        "--dtype", "float32",
        *flags,
        "--no-progress",
        "--cache-dir", str(tmp_path / "models"),
        "--output", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done, json.loads(out.read_text())


def test_bench_smoke_writes_a_report(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = _cli(
        "bench",
        "--workload", "smoke",
        "--dtype", "float32",
        "--compare", "inproc",
        "--unaligned",
        "--no-continuation",
        "--no-progress",
        "--cache-dir", str(tmp_path / "models"),
        "--output", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    section = report["by_dtype"]["float32"]
    for system in (
        "ferrum-grpc",
        "ferrum-inproc",
        "ferrum-grpc unaligned",
        "ferrum-grpc no continuation",
    ):
        result = section["results"][system]
        assert result["output_tokens"] == 12 * 8
        assert result["output_tok_s"] > 0 and result["itl_p99_ms"] >= result["itl_p50_ms"]
        assert result["steps"]["count"] == len(result["steps"]["records"]) > 0
    # Same policy, same numerics: identical greedy outputs with and without gRPC.
    assert section["derived"]["output_match_vs_ferrum_grpc"]["ferrum-inproc"] == 1.0
    # Aligned or not, the same greedy tokens; only the step mix differs.
    assert section["derived"]["output_match_vs_ferrum_grpc"]["ferrum-grpc unaligned"] == 1.0
    assert section["results"]["ferrum-grpc unaligned"]["notes"]["align_first_tokens"] is False
    # Decode continuation (the default): two steps in flight; without it one, and the same
    # greedy tokens either way.
    continued = section["results"]["ferrum-grpc"]["notes"]
    assert continued["decode_continuation"] is True
    assert continued["continuations"] > 0 and continued["max_in_flight"] == 2
    plain = section["results"]["ferrum-grpc no continuation"]["notes"]
    assert plain["decode_continuation"] is False
    assert plain["continuations"] == 0 and plain["max_in_flight"] == 1
    assert section["derived"]["output_match_vs_ferrum_grpc"]["ferrum-grpc no continuation"] == 1.0
    assert "ferrum-grpc / ferrum-inproc" in section["derived"]["ratios_output_tok_s"]
    assert "ferrum-grpc" in done.stdout  # the readable table
    # Each request's 7 fed decodes attend to its prompt and 1 .. 7 tokens more: the keys the
    # steps' records count, whichever kind of step carried them.
    prompts = WORKLOADS["smoke"].prompts()
    keys = sum(7 * len(p) + 28 for p in prompts)
    by_kind = section["results"]["ferrum-grpc"]["steps"]["by_kind"]
    assert sum(group["decode_keys"] for group in by_kind.values()) == keys
    floor = section["derived"]["memory_floor"]
    assert floor["read_gbs"] > 0 and floor["weight_bytes"] > 0
    assert floor["by_step_kind"]["decode"] > 0
    assert "of the memory floor" in done.stdout


def test_generate_local_prints_json() -> None:
    done = _cli(
        "generate", "--local", "--random", "3", "--max-new-tokens", "4", "--json",
        "--no-align-first-tokens", "--no-decode-continuation",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert [len(r["output_ids"]) for r in report["results"]] == [4, 4, 4]
    assert {r["finish_reason"] for r in report["results"]} == {"length"}


def test_generate_reads_prompts_and_streams(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[1, 2, 3, 4, 5], [9, 8, 7]]))
    done = _cli("generate", "--local", "--prompts", str(prompts), "--max-new-tokens", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split("\t") for line in done.stdout.splitlines()]
    assert sorted(int(i) for i, _ in lines) == [0, 0, 0, 1, 1, 1]


def test_bad_prompt_file_is_a_clean_error(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": [[1, "x"]]}))
    done = _cli("generate", "--local", "--prompts", str(prompts))
    assert done.returncode == 2 and "token-id lists" in done.stderr
    # A scheduler setting out of range fails the same way, before any server starts.
    done = _cli("generate", "--local", "--min-prefill-share", "1.5")
    assert done.returncode == 2 and "min_prefill_share must be within [0, 1]" in done.stderr


def test_long_and_shared_prefix_workloads() -> None:
    """w1-long: W1's prompts, 256 new tokens, a pool that holds every request at full length;
    w2-prefix: one 1,024-token system prompt then unique 32-128-token suffixes, prefix caching
    on in every system that has it (transformers is skipped), the prefix counted once."""
    import torch
    from ferrum_server.tools.bench.harness import _skip
    from ferrum_server.tools.bench.runners import _engine_args

    w1, long, prefix = WORKLOADS["w1"], WORKLOADS["w1-long"], WORKLOADS["w2-prefix"]
    assert long.prompts() == w1.prompts() and long.max_new_tokens == 256
    for workload in (long, prefix):
        prompts = workload.prompts()
        per_token = workload.model.kv_bytes_per_token(torch.float32)
        full = sum(len(p) + workload.max_new_tokens for p in prompts) * per_token
        assert len(prompts) == 64 and full <= workload.kv_cache_bytes  # nothing shared needed
    prompts = prefix.prompts()
    assert all(p[:1024] == prompts[0][:1024] for p in prompts)
    assert all(32 <= len(p) - 1024 <= 128 for p in prompts)
    assert len({tuple(p[1024:]) for p in prompts}) == 64
    assert not long.prefix_caching and prefix.prefix_caching
    uncached = matmul_flops(dataclasses.replace(prefix, prefix_caching=False), prompts)
    cached = matmul_flops(prefix, prompts)
    per_token = (uncached["linear"] - cached["linear"]) / (63 * 1024)  # 63 prefixes not rerun
    assert per_token == pytest.approx(uncached["linear"] / sum(len(p) + 63 for p in prompts))
    spec = RunSpec("ferrum-grpc", "w2-prefix", "m", "float32", prompts, 64, prefix_caching=True)
    args = _engine_args(spec)
    assert args[args.index("--prefix-caching") + 1] == "true"
    skipped: dict[str, str] = {}
    hf = dataclasses.replace(spec, system="hf-static")
    assert _skip("hf-static", hf, "offline", skipped, io.StringIO())
    assert "prefix caching" in skipped["hf-static"]
    assert not _skip("ferrum-grpc", spec, "offline", skipped, io.StringIO())


def test_the_vllm_worker_runs_with_tcmalloc_and_intel_openmp_when_present(tmp_path: Path) -> None:
    """Found under the venv or the system's library folders, preloaded into the worker's
    environment (kept before any LD_PRELOAD already set) and recorded in the result's notes."""
    from ferrum_server.tools.bench.runners import run_vllm, vllm_preloads

    venv, system = tmp_path / "venv", tmp_path / "system"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    system.mkdir()
    assert vllm_preloads(venv, [str(system)]) == {}
    iomp = venv / "lib" / "libiomp5.so"
    iomp.write_bytes(b"")
    for name in ("libtcmalloc.so.4", "libtcmalloc_minimal.so.4"):
        (system / name).write_bytes(b"")
    assert vllm_preloads(venv, [str(system)]) == {
        "tcmalloc": str(system / "libtcmalloc_minimal.so.4"),  # the minimal one first
        "iomp": str(iomp),
    }
    # A stand-in for the venv's interpreter (argv: itself, worker, IN, OUT): it reports the
    # LD_PRELOAD it was started with, and leaves an IPC socket's file where vLLM would.
    python = venv / "bin" / "python"
    python.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        "rpc = os.environ['VLLM_RPC_BASE_PATH']\n"
        "open(os.path.join(rpc, 'socket'), 'w').close()\n"
        "notes = {'seen': os.environ['LD_PRELOAD'], 'rpc': rpc}\n"
        "out = {'wall_s': 1.0, 'requests': [], 'notes': notes}\n"
        "open(sys.argv[3], 'w').write(json.dumps(out))\n"
    )
    python.chmod(0o755)
    spec = RunSpec("vllm", "smoke", "m", "float32", [[1]], 1, vllm_python=str(python))
    os.environ["LD_PRELOAD"] = "/elsewhere/libother.so"
    try:
        run = run_vllm(spec)
    finally:
        del os.environ["LD_PRELOAD"]
    found, preload = run.notes["preloads_found"], run.notes["ld_preload"]
    assert found["iomp"] == str(iomp)  # (tcmalloc too if this machine has it)
    assert preload == [*found.values(), "/elsewhere/libother.so"]
    assert run.notes["seen"] == ":".join(preload)
    assert not Path(run.notes["rpc"]).exists()  # the run's folder went, sockets and all


def test_summary_statistics() -> None:
    assert percentile([], 50) == 0.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    run = RunOutput(
        "x",
        2.0,
        [RequestTrace(0.0, [0.5, 1.0, 2.0], [1, 2, 3]), RequestTrace(0.5, [1.0, 1.5], [4, 5])],
    )
    summary = summarize(run, [[1, 2], [3]])
    assert summary["output_tok_s"] == 2.5
    assert summary["ttft_p50_ms"] == 500.0
    assert summary["prefill_tok_s"] == 3.0  # 3 prompt tokens, last first token at 1.0 s
    flops = matmul_flops(WORKLOADS["w1"], WORKLOADS["w1"].prompts())
    # W1: ~4.7 TFLOP in transformers' accounting (LM head on every row), less when only the
    # rows that produce a token go through the head.
    assert 4.0e12 < flops["matmul_all_rows"] < 5.5e12
    assert flops["matmul"] < flops["matmul_all_rows"]


def test_repeated_rounds_interleave_systems_and_report_the_median_round(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """--repeat N runs every system once per round, in turn, each round starting one system
    further along the plan, and each row is its median round (walls scripted here: no model
    runs)."""
    from ferrum_server.tools.bench import harness

    walls = {"ferrum-grpc": [4.0, 2.0, 3.0], "ferrum-inproc": [1.0, 5.0, 2.0]}
    order: list[str] = []

    def fake_worker(spec: RunSpec) -> RunOutput:
        order.append(spec.system)
        wall = walls[spec.system][order.count(spec.system) - 1]
        traces = [RequestTrace(0.0, [0.1, wall], [7, 8]) for _ in range(3)]
        return RunOutput(spec.system, wall, traces)

    monkeypatch.setattr(harness, "_run_worker", fake_worker)
    probes = iter([3.0, 5.0, 4.0])
    monkeypatch.setattr(
        harness, "measure_gemm", lambda workload, dtype: {"packed": next(probes), "onednn": 1.0}
    )
    reads = iter([61.5, 44.0, 80.25])
    monkeypatch.setattr(harness, "measure_memory_read", lambda: next(reads))
    report = harness.run_bench(
        "smoke", ["float32"], ["inproc"], repeat=3, cache_dir=tmp_path, progress=False,
        log=io.StringIO(),
    )  # fmt: skip
    grpc, inproc = "ferrum-grpc", "ferrum-inproc"
    assert order == [grpc, inproc, inproc, grpc, grpc, inproc]
    # The memory read rate is taken before every round and kept round by round.
    assert report["by_dtype"]["float32"]["memory_read_gbs"] == [61.5, 44.0, 80.25]
    assert "memory read GB/s by round: [61.5, 44.0, 80.25]" in harness.format_table(report)
    # So is the GEMM probe's best rate; the ceiling takes each kernel's best over the rounds.
    assert report["by_dtype"]["float32"]["gemm_gflops_by_round"] == [3.0, 5.0, 4.0]
    assert report["by_dtype"]["float32"]["gemm_gflops"] == {"packed": 5.0, "onednn": 1.0}
    assert "best GEMM GFLOP/s by round: [3.0, 5.0, 4.0]" in harness.format_table(report)
    results = report["by_dtype"]["float32"]["results"]
    assert results["ferrum-grpc"]["rounds_output_tok_s"] == [1.5, 3.0, 2.0]
    assert results["ferrum-grpc"]["wall_s"] == 3.0  # the median round: 2.0 tok/s
    assert results["ferrum-inproc"]["wall_s"] == 2.0  # rounds 6.0, 1.2, 3.0 tok/s
    ratio = report["by_dtype"]["float32"]["derived"]["ratios_output_tok_s"]
    assert ratio["ferrum-grpc / ferrum-inproc"] == pytest.approx(2.0 / 3.0, abs=1e-3)
    assert "by round" in harness.format_table(report)


def test_prefill_shares_run_as_extra_rows_and_bad_shares_are_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """--prefill-shares adds a row per other share with the step-time target kept (the base
    share is not run twice); a share outside 0..1 is refused before anything runs."""
    from ferrum_server.tools.bench import harness

    seen: list[tuple[str, float, float]] = []

    def fake_worker(spec: RunSpec) -> RunOutput:
        seen.append((spec.system, spec.min_prefill_share, spec.target_step_ms))
        return RunOutput(spec.system, 1.0, [RequestTrace(0.0, [0.1, 0.2], [7, 8])])

    monkeypatch.setattr(harness, "_run_worker", fake_worker)
    monkeypatch.setattr(harness, "measure_gemm", lambda workload, dtype: {"packed": 1.0})
    report = harness.run_bench(
        "smoke", ["float32"], [], min_prefill_share=0.25, prefill_shares=[0.25, 0.0, 0.5],
        cache_dir=tmp_path, progress=False, log=io.StringIO(),
    )  # fmt: skip
    assert seen == [("ferrum-grpc", 0.25, 200.0), ("ferrum-grpc", 0.0, 200.0),
                    ("ferrum-grpc", 0.5, 200.0)]  # fmt: skip
    assert set(report["by_dtype"]["float32"]["results"]) == {
        "ferrum-grpc",
        "ferrum-grpc share@0",
        "ferrum-grpc share@0.5",
    }
    done = _cli("bench", "--workload", "smoke", "--prefill-shares", "0.5,1.5")
    assert done.returncode == 2 and "prefill shares must be within 0..1" in done.stderr


def test_planned_at_once_runs_as_an_extra_row_and_a_bad_lead_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """--continuation-lead-ms sets the rows' lead ('none': plan at once), --planned-at-once adds
    a row that plans each continued step at once (not when the lead is already off); a
    negative lead is refused before anything runs."""
    from ferrum_server.tools.bench import harness

    seen: list[tuple[str, float | None]] = []

    def fake_worker(spec: RunSpec) -> RunOutput:
        seen.append((spec.system, spec.continuation_lead_ms))
        return RunOutput(spec.system, 1.0, [RequestTrace(0.0, [0.1, 0.2], [7, 8])])

    monkeypatch.setattr(harness, "_run_worker", fake_worker)
    monkeypatch.setattr(harness, "measure_gemm", lambda workload, dtype: {"packed": 1.0})
    report = harness.run_bench(
        "smoke", ["float32"], [], continuation_lead_ms=8.0, planned_at_once=True,
        cache_dir=tmp_path, progress=False, log=io.StringIO(),
    )  # fmt: skip
    assert seen == [("ferrum-grpc", 8.0), ("ferrum-grpc", None)]
    assert set(report["by_dtype"]["float32"]["results"]) == {
        "ferrum-grpc",
        "ferrum-grpc planned at once",
    }
    seen.clear()
    harness.run_bench(
        "smoke", ["float32"], [], continuation_lead_ms=None, planned_at_once=True,
        cache_dir=tmp_path, progress=False, log=io.StringIO(),
    )  # fmt: skip
    assert seen == [("ferrum-grpc", None)]
    done = _cli("bench", "--workload", "smoke", "--continuation-lead-ms", "-1")
    assert done.returncode == 2 and "must be within [0, 1e6) ms" in done.stderr
    with pytest.raises(ValueError, match="continuation_lead_ms"):
        SchedulerConfig(continuation_lead_ms=-1.0)


def test_bench_drives_several_local_executors_as_one_fleet(tmp_path: Path) -> None:
    _, report = _smoke_bench(tmp_path, "--compare", "inproc", "--executors", "2")
    section = report["by_dtype"]["float32"]
    fleet = section["results"]["ferrum-grpc"]
    assert fleet["notes"]["executors"] == 2
    assert fleet["output_tokens"] == 12 * 8
    # Two executors, one policy: the same greedy tokens as one in-process engine.
    matches = section["derived"]["output_match_vs_ferrum_grpc"]
    assert matches["ferrum-inproc"] == 1.0
    # With decode continuation (the default) over the fleet: continued on both lanes.
    continued = fleet["notes"]
    assert continued["executors"] == 2 and continued["continuations"] > 0
    assert continued["max_in_flight"] == 2
    bad = _cli("bench", "--workload", "smoke", "--executors", "0")
    assert bad.returncode == 2 and "--executors" in bad.stderr


def test_bench_runs_the_model_split_over_two_ranks_beside_it(tmp_path: Path) -> None:
    _, report = _smoke_bench(tmp_path, "--tensor-parallel-size", "2")
    section = report["by_dtype"]["float32"]
    split = section["results"]["ferrum-grpc tp2"]
    assert split["notes"]["tensor_parallel_size"] == 2
    assert split["output_tokens"] == 12 * 8
    # Rank 0's steps spent measurable time in all-reduces, reported per step.
    assert split["steps"]["collective_ms_mean"] > 0
    assert section["results"]["ferrum-grpc"]["steps"]["collective_ms_mean"] == 0
    assert section["derived"]["output_match_vs_ferrum_grpc"]["ferrum-grpc tp2"] == 1.0
    assert split["peak_rss_mb"]["rank1"] > 0  # the follower's own peak, beside rank 0's
    bad = _cli("bench", "--workload", "smoke", "--tensor-parallel-size", "0")
    assert bad.returncode == 2 and "--tensor-parallel-size" in bad.stderr


ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False
    )


def test_bench_against_a_revision_runs_its_server_beside_this_one(tmp_path: Path) -> None:
    head = _git("rev-parse", "HEAD")
    if head.returncode != 0:
        pytest.skip("not a git checkout: --against needs one")
    commit = head.stdout.strip()
    done, report = _smoke_bench(tmp_path, "--against", "HEAD")
    assert report["against"] == {"revision": "HEAD", "commit": commit}
    section = report["by_dtype"]["float32"]
    label = f"ferrum-grpc@{commit[:10]}"
    before = section["results"][label]
    assert before["output_tokens"] == 12 * 8 and before["output_tok_s"] > 0
    # Its server ran from a worktree of the revision (revision_checkout checked that a process
    # given this path imports the worktree's server), and the worktree is gone again.
    parts = before["notes"]["server_path"].split(os.pathsep)
    assert [Path(part).name for part in parts] == ["server", "kernels", "client"]
    assert all("ferrum-against-" in part and not Path(part).exists() for part in parts)
    assert "ferrum-against-" not in _git("worktree", "list", "--porcelain").stdout
    assert f"ferrum-grpc / {label}" in section["derived"]["ratios_output_tok_s"]
    assert label in section["derived"]["output_match_vs_ferrum_grpc"]
    assert f"against revision HEAD ({commit})" in done.stdout
    assert f"{label} engine time:" in done.stdout
    bad = _cli("bench", "--workload", "smoke", "--against", "no-such-revision-of-ferrum")
    assert bad.returncode == 2 and "names no commit" in bad.stderr


def test_a_folder_outside_git_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    from ferrum_server.tools.bench.revision import revision_checkout

    with (
        pytest.raises(ValueError, match="is not a git checkout"),
        revision_checkout("HEAD", repository=tmp_path),
    ):
        pass
    assert list(tmp_path.iterdir()) == []


def test_memory_read_probe_reports_a_rate() -> None:
    from ferrum_server.tools.bench import harness

    rate = harness.measure_memory_read(megabytes=8, passes=2)
    assert isinstance(rate, float) and 0.1 < rate < 10_000
