"""The C allocator is told to keep freed activation buffers before the model loads, and the
plain weights start-up frees are handed back to the kernel as each is freed
(ferrum_server.host_memory)."""

from __future__ import annotations

import ctypes.util
import resource
from pathlib import Path
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


def _vm_flags(address: int) -> list[str]:
    """The kernel's flags for the mapping holding `address` (/proc/self/smaps' VmFlags)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


_LINUX = Path("/proc/self/smaps").is_file()


def test_huge_page_range_takes_the_whole_huge_pages_inside_a_buffer() -> None:
    mib2 = host_memory.HUGE_PAGE_BYTES
    assert host_memory.huge_page_range(0, 3 * mib2) == (0, 3 * mib2)
    assert host_memory.huge_page_range(4096, 3 * mib2) == (mib2, 2 * mib2)  # both ends partial
    assert host_memory.huge_page_range(mib2 - 1, mib2) == (mib2, 0)  # none whole
    assert host_memory.huge_page_range(5 * mib2 + 64, 2 * mib2) == (6 * mib2, mib2)


@pytest.mark.skipif(not (_GLIBC and _LINUX), reason="madvise and /proc/self/smaps are Linux's")
def test_advise_huge_pages_marks_the_buffers_whole_huge_pages_and_refuses_device_memory() -> None:
    import mmap

    import torch

    # A fresh anonymous mapping of its own, untouched yet. (torch.empty of 64 MiB is not always
    # one: with freed memory kept (keep_freed_memory), glibc may hand out a free heap region that
    # an in-process engine of an earlier test advised already.)
    mapping = mmap.mmap(-1, 64 * 1024**2)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    start, length = host_memory.huge_page_range(buffer.data_ptr(), buffer.numel())
    assert length >= 62 * 1024**2
    assert "hg" not in _vm_flags(start)
    assert host_memory.advise_huge_pages(buffer) == length
    # madvise split the mapping at the advised range: inside it is marked, the partial head not.
    assert "hg" in _vm_flags(start) and "hg" in _vm_flags(start + length - 1)
    if start > buffer.data_ptr():
        assert "hg" not in _vm_flags(start - 1)
    assert host_memory.advise_huge_pages(torch.empty(1024)) == 0  # no whole huge page
    with pytest.raises(ValueError, match="host memory"):
        host_memory.advise_huge_pages(torch.empty(8, device="meta"))
    assert host_memory.transparent_huge_pages() in ("always", "madvise", "never", "")


@pytest.mark.skipif(not (_GLIBC and _LINUX), reason="madvise and /proc/self/smaps are Linux's")
def test_a_cpu_kv_pool_is_advised_huge_pages_and_starts_zeroed() -> None:
    # A pool above glibc's largest mmap threshold, so in a mapping no other buffer shares.
    parts = startup.build_parts(EngineConfig(model="tiny", kv_cache_bytes=64 * 1024**2), 1)
    pool = parts.kv_cache
    assert pool.numel() * pool.element_size() > 32 * 1024**2
    start, length = host_memory.huge_page_range(pool.data_ptr(), pool.numel() * pool.element_size())
    assert length > 0 and "hg" in _vm_flags(start)
    assert not pool.any()  # advised before its first write, then zeroed as before


@pytest.mark.skipif(not (_GLIBC and _LINUX), reason="madvise and /proc/self/smaps are Linux's")
def test_kv_huge_pages_false_does_not_advise_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    # Whether the pool is advised, not its mapping's flags: with freed memory kept
    # (keep_freed_memory), the pool may take a heap region an earlier test's pool had advised.
    advised: list[int] = []

    def spy(buffer: Any) -> int:
        advised.append(buffer.data_ptr())
        return 0

    monkeypatch.setattr(host_memory, "advise_huge_pages", spy)
    config = EngineConfig(model="tiny", kv_cache_bytes=64 * 1024**2, kv_huge_pages=False)
    pool = startup.build_parts(config, 1).kv_cache
    assert advised == []
    assert not pool.any()
    # The same build with huge pages on advises the pool (the spy sees the call).
    startup.build_parts(EngineConfig(model="tiny", kv_cache_bytes=64 * 1024**2), 1)
    assert len(advised) == 1
