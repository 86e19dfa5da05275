"""How a CPU executor's host memory is held: the C allocator's treatment of activations, and
huge pages under the KV pool.

A CPU forward allocates its activations with the C allocator (torch has no caching allocator
on the host), and a step's largest buffers are megabytes: a 512-token step's gate/up output is 4
MiB in bfloat16. glibc hands such a buffer back to the kernel when it is freed (an mmap above
its threshold, or a trimmed heap top), so the next step page-faults and zeroes it all again. On
the development machine a W1 bfloat16 prefill step took about 11,500 minor faults and 280 ms
that way, against 2 faults and 212 ms with the memory kept (`python
benchmarks/profile_w1_steps.py --dtype bfloat16 --kernels`, docs/benchmarks.md).

`keep_freed_memory` must run before the model loads. Set after the weights were read (where it
was first called), the same thresholds left a bfloat16 prefill step at about 11,500 faults in
an in-process engine; set before (or through GLIBC_TUNABLES at process start), 2-135. Why the
order matters was not pinned down: presumably where the weights and the first activations land
in the engine thread's arena. A served executor happened not to fault either way.

Keeping freed memory would also keep the plain weights that start-up frees once they are
packed, so start-up calls `return_free_pages` after freeing each one (and once at its end): held
until the end, they stacked under the packed copies made meanwhile, and W1 float32's start-up
peak swung by 35-150 MB with where the allocator put those copies. The steps that reuse the
pages fault once and then keep them.

`share_main_arena` has every thread started afterwards allocate from glibc's main arena, and
must run before the engine thread starts. A thread of its own arena (glibc's default) draws from
heaps of 64 MiB, and with the engine thread's activations there a served float32 W1 run took
10-440 thousand minor faults, changing from run to run; with one arena (this call, or
`GLIBC_TUNABLES=glibc.malloc.arena_max=1` at process start) 4-20 thousand, and it ran 2-4%
faster (docs/benchmarks.md, twenty-fourth session). Where the faults come from in the other
arenas was not pinned down.

`advise_huge_pages` asks the kernel for transparent huge pages (2 MiB) under a long-lived
buffer: start-up advises the KV pool before zeroing it. A decode step reads every item's K/V
blocks (about 250 MB a step on W1, out of a 1 GiB pool): in 4 KiB pages that pool spans about
260,000 pages, far more than a TLB holds, so block reads keep walking the page tables; in 2
MiB pages it spans 512. Once requests have come and gone, an item's blocks lie scattered over
the pool: there the decode attention ran 4-12% faster with huge pages, and 1-8% over blocks
in order, as a fresh pool hands them out (docs/benchmarks.md, thirty-first session). It is
advice (madvise(MADV_HUGEPAGE)): the kernel follows it where
/sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise` (`never` turns it off
for the machine), and only for pages not yet touched, which is why the pool is advised while
empty. The price is start-up: the pool's zeroing, in huge pages, took 0.5-1.1 s more per GiB
on the development machine (no compaction stalls: the huge page faults themselves), so
`--kv-huge-pages false` (EngineConfig.kv_huge_pages) skips the advice.

The allocator settings, the page return and the huge page advice are no-ops off glibc (the
advice goes through glibc's `madvise`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

import torch

from ferrum_server import logs

_LOG = logs.get(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 * 1024**2  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
# mallopt takes a C int: 4 GiB would wrap to 0, which means "trim on every free", the opposite
# of the intent (that bug once cost about 750k page faults per W1 run).
TRIM_THRESHOLD = 2**31 - 1
HUGE_PAGE_BYTES = 2 * 1024**2  # x86-64's and arm64's (4 KiB base pages) transparent huge page
_MADV_HUGEPAGE = 14  # linux/mman.h
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):  # not glibc: no mallopt or malloc_trim
        return None
    return libc


def keep_freed_memory() -> bool:
    """Have glibc keep freed buffers below 32 MiB for reuse instead of returning them to the
    kernel: no mmap for them, and no trimming of the heap's top. Returns whether both settings
    took (False off glibc)."""
    libc = _libc()
    if libc is None:
        return False
    kept = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    kept = bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and kept
    _LOG.info("host_memory_kept", kept=kept, mmap_threshold=MMAP_THRESHOLD)
    return kept


def share_main_arena() -> bool:
    """Have glibc create no more arenas: threads that allocate for the first time from now on
    use the main one (or another that exists already). Returns whether it took (False off
    glibc)."""
    libc = _libc()
    if libc is None:
        return False
    shared = bool(libc.mallopt(_M_ARENA_MAX, 1))
    _LOG.info("host_memory_arenas", shared=shared)
    return shared


def return_free_pages() -> bool:
    """Give every free page of every arena back to the kernel (glibc's `malloc_trim(0)`), e.g.
    once start-up has freed the plain weights. Returns whether any memory was released."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.malloc_trim(0))


def transparent_huge_pages() -> str:
    """The machine's transparent huge page mode ("always", "madvise" or "never"), or "" where
    the kernel does not say (not Linux, or no THP support)."""
    try:
        text = _THP_MODE.read_text()
    except OSError:
        return ""
    chosen = [word[1:-1] for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else ""


def huge_page_range(address: int, length: int) -> tuple[int, int]:
    """The whole 2 MiB pages inside [address, address + length): (start, length), length 0 when
    the buffer holds none."""
    start = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (address + length) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    return start, max(0, end - start)


def advise_huge_pages(buffer: torch.Tensor) -> int:
    """Advise transparent huge pages for the whole 2 MiB pages of a CPU tensor's storage (its
    first and last partial pages keep 4 KiB ones). Call it before the buffer is first written:
    pages already touched stay small. Returns the bytes advised: 0 off glibc, for a buffer
    holding no whole huge page, or where the kernel refused (logged)."""
    if buffer.device.type != "cpu":
        raise ValueError(f"huge pages are advised for host memory, not {buffer.device}")
    storage = buffer.untyped_storage()
    start, length = huge_page_range(storage.data_ptr(), storage.nbytes())
    libc = _libc() if length else None
    if libc is None:
        return 0
    if libc.madvise(start, length, _MADV_HUGEPAGE) != 0:
        error = ctypes.get_errno()
        _LOG.warning("huge_pages_refused", bytes=length, reason=os.strerror(error))
        return 0
    return length
