"""How the C allocator treats the host memory of a CPU executor's activations.

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

All three are no-ops off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from ferrum_server import logs

_LOG = logs.get(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 * 1024**2  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
# mallopt takes a C int: 4 GiB would wrap to 0, which means "trim on every free", the opposite
# of the intent (that bug once cost about 750k page faults per W1 run).
TRIM_THRESHOLD = 2**31 - 1


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
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
