"""The C allocator is told to keep freed activation buffers before the model loads, and the
plain weights start-up frees are handed back to the kernel as each is freed
(ferrum_server.host_memory)."""

from __future__ import annotations

import ctypes.util
import resource
from typing import Any

import pytest
from ferrum_kernels.cpu_linear import PackedLinear
from ferrum_server import host_memory, startup
from ferrum_server.config import EngineConfig
from ferrum_server.tools.bench.runners import minor_faults

_GLIBC = ctypes.util.find_library("c") is not None


def test_start_up_keeps_freed_memory_before_the_weights_load_and_returns_their_pages_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Set after the weights were read, the same settings left a W1 bfloat16 prefill step at
    about 11,500 page faults (module docstring): the order is the point."""
    calls: list[str] = []

    def recorded(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(
        host_memory, "keep_freed_memory", recorded("keep", host_memory.keep_freed_memory)
    )
    monkeypatch.setattr(
        host_memory, "return_free_pages", recorded("return", host_memory.return_free_pages)
    )
    monkeypatch.setattr(startup, "load_model", recorded("load", startup.load_model))
    monkeypatch.setattr(
        startup, "release_plain_weights", recorded("release", startup.release_plain_weights)
    )
    parts = startup.build_parts(EngineConfig(model="tiny", kv_cache_bytes=4 * 1024**2), 1)
    assert parts.device.type == "cpu"
    # The pages go back after each packed linear's plain weight is freed, and once at the end.
    packed = sum(isinstance(m, PackedLinear) and m._pack is not None for m in parts.model.modules())
    assert packed > 0
    assert calls == ["keep", "load", "release"] + ["return"] * (packed + 1)


def test_a_cpu_engine_shares_the_main_arena_before_its_thread_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine thread and its OpenMP workers must first allocate after the setting, so they
    use the main arena (module docstring: a served float32 W1 run took 10-440 thousand faults
    otherwise)."""
    import threading

    from ferrum_server import engine as engine_module

    calls: list[str] = []
    share = host_memory.share_main_arena
    build = engine_module.build_parts

    def shared() -> bool:
        calls.append("arena")
        return share()

    def built(*args: Any, **kwargs: Any) -> Any:
        calls.append(threading.current_thread().name.split("_")[0])
        return build(*args, **kwargs)

    monkeypatch.setattr(host_memory, "share_main_arena", shared)
    monkeypatch.setattr(engine_module, "build_parts", built)
    engine = engine_module.Engine(EngineConfig(model="tiny", kv_cache_bytes=4 * 1024**2))
    engine.shutdown()
    assert calls == ["arena", "ferrum-engine"]


@pytest.mark.skipif(not _GLIBC, reason="mallopt and malloc_trim are glibc's")
def test_the_allocator_settings_take_on_glibc() -> None:
    assert host_memory.keep_freed_memory() is True
    assert host_memory.share_main_arena() is True
    host_memory.return_free_pages()  # whether anything was free to return varies; no error


def test_minor_faults_reads_the_count_the_kernel_keeps() -> None:
    ours = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    read = minor_faults()
    assert ours <= read <= resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    assert minor_faults(2**31 - 1) == 0  # no such process


def test_release_plain_weights_calls_back_after_each_weight_it_frees() -> None:
    """The callback start-up uses to hand each plain weight's pages back runs once per freed
    weight, after it is freed, and not for weights already released."""
    import torch
    from ferrum_kernels.cpu_linear import mkldnn_linear_available, prepack_linears
    from ferrum_kernels.cpu_linear import release_plain_weights as release
    from torch import nn

    if not mkldnn_linear_available():
        pytest.skip("no packed linears on this CPU")
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    assert prepack_linears(model) == 2
    plain = [m.weight for m in model if isinstance(m, PackedLinear)]
    seen: list[list[int]] = []

    def after() -> None:
        seen.append([p.numel() for p in plain])

    freed = release(model, after_each=after)
    assert freed == (16 * 32 + 32 * 8) * torch.float32.itemsize
    assert seen == [[0, 32 * 8], [0, 0]]  # the first freed, then both
    assert release(model, after_each=after) == 0 and len(seen) == 2
