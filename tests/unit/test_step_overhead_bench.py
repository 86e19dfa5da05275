"""A seconds-long smoke run of the per-step host overhead bench (as CI runs it)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from helpers_scripts import load_script

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "step_overhead_bench.py"


@pytest.mark.parametrize(("wire", "continuation"), [(False, False), (True, False), (True, True)])
def test_smoke_run_times_every_phase(
    wire: bool,
    continuation: bool,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bench: Any = load_script("ferrum_step_overhead_bench", _BENCH)
    import ferrum_server.validate as validate_module

    continued: list[int] = []
    resolve = validate_module._continue

    def counting(index: int, item: Any, kv: Any) -> Any:
        continued.append(index)
        return resolve(index, item, kv)

    monkeypatch.setattr(validate_module, "_continue", counting)
    args = ["--batches", "3,8", "--steps", "3", "--rounds", "2", "--layers", "2"]
    args += ["--wire"] if wire else []
    medians = bench.main(args + (["--continuation"] if continuation else []))
    # The measured rounds' decodes continue from their caches' tokens (3 and 8 a step, 2
    # rounds of 3 steps each), or none do.
    assert len(continued) == (3 + 8) * 2 * 3 * continuation
    assert sorted(medians) == [3, 8]
    for row in medians.values():
        # Every wrapped phase ran, and the parts add up to the step.
        for phase in ("validate", "reserve", "plan", "model", "select", "commit", "record"):
            assert row[phase] > 0, phase
        assert (row["wire"] > 0) == wire
        parts = sum(row[p] for p in bench.PHASES)
        assert parts == pytest.approx(row["step"], rel=1e-6)
        assert 0 < row["host"] < row["step"]
    out = capsys.readouterr().out
    assert "| 8 |" in out and ("wire" in out) == wire


def test_dtype_selects_the_engines_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    bench: Any = load_script("ferrum_step_overhead_bench", _BENCH)
    from ferrum_server.engine import Engine

    dtypes: list[str] = []
    init = Engine.__init__

    def recording(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        dtypes.append(config.dtype)
        init(self, config, *args, **kwargs)

    monkeypatch.setattr(Engine, "__init__", recording)
    bench.main(["--batches", "2", "--steps", "1", "--rounds", "1", "--dtype", "bfloat16"])
    assert dtypes == ["bfloat16"]
    with pytest.raises(SystemExit):
        bench.main(["--dtype", "float16"])


def test_wrappers_come_off_after_a_run() -> None:
    bench: Any = load_script("ferrum_step_overhead_bench", _BENCH)
    import ferrum_server.engine as engine_module

    validate = engine_module.validate_step
    bench.main(["--batches", "2", "--steps", "1", "--rounds", "1"])
    assert engine_module.validate_step is validate


@pytest.mark.parametrize(
    "args", [["--batches", "0"], ["--batches", "a,2"], ["--steps", "0"], ["--layers", "0"]]
)
def test_bad_counts_are_refused(args: list[str]) -> None:
    bench: Any = load_script("ferrum_step_overhead_bench", _BENCH)
    with pytest.raises(SystemExit):
        bench.main(args)


def test_no_torch_work_runs_on_the_calling_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The weights are built on a thread of their own and the steps run on the engine thread, as
    in a server: a torch call on the calling thread would open a second OpenMP team, and libgomp
    then throttles every team's spin-waits, which slowed a 12-layer tiny decode step by about
    60% (7.4-8.0 against 12.7-13.1 ms)."""
    bench: Any = load_script("ferrum_step_overhead_bench", _BENCH)
    from ferrum_server.engine import Engine

    threads: dict[str, set[threading.Thread]] = {"build": set(), "execute": set()}
    build, execute = bench.build_weights, Engine.execute

    def recorded_build(*args: Any, **kwargs: Any) -> Any:
        threads["build"].add(threading.current_thread())
        return build(*args, **kwargs)

    def recorded_execute(self: Engine, *args: Any, **kwargs: Any) -> Any:
        threads["execute"].add(threading.current_thread())
        return execute(self, *args, **kwargs)

    monkeypatch.setattr(bench, "build_weights", recorded_build)
    monkeypatch.setattr(Engine, "execute", recorded_execute)
    bench.main(["--batches", "2", "--steps", "1", "--rounds", "1"])
    assert threads["build"] and threads["execute"]
    assert threading.current_thread() not in threads["build"] | threads["execute"]
    # Every step on one thread: the engine's.
    assert len(threads["execute"]) == 1
