"""Freed blocks kept for reuse on CPUs (glibc's malloc).

A layer recomputed block by block allocates and frees blocks of tens of megabytes, many
times per layer: probabilities, products, measures. glibc gives such blocks back to the
system as they are freed (each is its own mapping, or the top of the heap is trimmed), so
the next one is mapped afresh and its pages faulted in and zeroed one by one, which at long
context costs about as much as the arithmetic on them. :func:`keep_freed_blocks` asks
malloc, once per process, to serve blocks up to :data:`MMAP_FROM` from its heap and to
keep up to :data:`TRIM_FROM` of freed heap for reuse. The cost: a process's resident size
no longer shrinks after a long trace by what it freed below those sizes (it is reused by
the next). Set ``CW_KEEP_FREED_MEMORY=0`` to leave malloc as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

#: allocations from this size on still get a mapping of their own (returned when freed)
MMAP_FROM = 256 * 1024**2
#: free memory at the heap's top kept for reuse, up to this
TRIM_FROM = 1024**3
#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


@functools.cache
def keep_freed_blocks() -> bool:
    """Tune malloc as the module docstring says, once; whether it was done (False off
    Linux, where the C library is not glibc, or with ``CW_KEEP_FREED_MEMORY=0``)."""
    if os.environ.get("CW_KEEP_FREED_MEMORY", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_FROM)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_FROM)
    )
