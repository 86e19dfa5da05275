"""All torch work of an Engine stays on its engine thread.

On CPU, a second thread that opens an OpenMP team (for example the asyncio thread loading the
model) makes libgomp throttle the spin-waits of every team, and each forward pays a futex wake per
parallel region: about a quarter of a W1 prefill step. The check runs in a fresh interpreter,
because pytest's own process may already have a main-thread team.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

_SCRIPT = textwrap.dedent(
    """
    import os, torch
    from ferrum_server.config import EngineConfig
    from ferrum_server.engine import Engine

    def threads():
        return len(os.listdir("/proc/self/task"))

    engine = Engine(EngineConfig(model="tiny", torch_threads=2, kv_cache_bytes=64 * 1024**2))
    engine.call_sync(engine.warmup, 0)
    before = threads()
    # A parallel region on this (main) thread opens its team now, unless one already exists.
    (torch.ones(1 << 22) * 2).sum()
    print(before, threads())
    engine.shutdown()
    """
)


def test_model_load_and_warmup_open_no_openmp_team_on_the_calling_thread() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env={
            "FERRUM_LOG_LEVEL": "warning",
            # The venv's bin first, as for a served executor: the native kernels' build then uses
            # the same ninja as every other process, so this test loads their cached build.
            # With Debian's older ninja first it would get a build of its own (native.py keys
            # the build by ninja): about 75 s more per suite run.
            "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
            "OMP_NUM_THREADS": "2",
        },
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = (int(x) for x in done.stdout.split()[-2:])
    # The main thread's first parallel region adds its one worker only now: the engine never
    # ran torch on the calling thread.
    assert after == before + 1, (before, after)
