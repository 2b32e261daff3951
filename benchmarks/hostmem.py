"""Host buffers for the sweeps, backed by the same kind of pages in every run.

A copy between processes costs less on 2 MiB transparent huge pages than on
4 KiB pages: ``process_vm_readv``, which MPI's shared-memory path and pycoll's
direct reads both use, pins the peer's pages, and a huge page pins at once.  On
the 2-core machine a 2 MiB broadcast at n = 2 took MPI 81 us on huge pages and
160 us on small ones (pycoll: 60 and 100 us).

NumPy asks for huge pages (``madvise``) for arrays of 4 MiB and more.  A smaller
array lands wherever the allocator's history puts it: in a sweep that had just
freed large arrays, a 2 MiB array often sat on huge pages, in the next run not.
That made the 2 MiB points of whole sweeps swing by up to 2x between runs.  So the
sweeps map each buffer themselves, 2 MiB-aligned, and back it by policy:

* ``numpy`` (the default): huge pages from 4 MiB, where NumPy asks for them;
  below that, what the system's policy gives a fresh mapping (on most machines,
  ``madvise`` mode: small pages).  What a fresh NumPy array of that size gets.
* ``on``: huge pages at every size (``MADV_HUGEPAGE``).
* ``off``: never (``MADV_NOHUGEPAGE``).

:func:`hugepage_fraction` reads back what the kernel gave (``/proc/self/smaps``).
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

HUGE = 2 << 20
#: NumPy's ``madvise(MADV_HUGEPAGE)`` threshold (numpy/_core/src/multiarray/alloc.c)
NUMPY_HUGE_FROM = 4 << 20
POLICIES = ("numpy", "on", "off")


def empty(count: int, dtype: Any, hugepages: str = "numpy") -> np.ndarray:
    """An uninitialised 1-D array of ``count`` elements in its own mapping."""
    if hugepages not in POLICIES:
        raise ValueError(f"hugepages must be one of {', '.join(POLICIES)}, not {hugepages!r}")
    dtype = np.dtype(dtype)
    nbytes = count * dtype.itemsize
    span = max(HUGE, -(-nbytes // HUGE) * HUGE)
    m = mmap.mmap(-1, span + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(m, np.uint8)  # holds the mapping: unmapped with the array
    off = -whole.__array_interface__["data"][0] % HUGE
    if hugepages == "on" or (hugepages == "numpy" and nbytes >= NUMPY_HUGE_FROM):
        m.madvise(mmap.MADV_HUGEPAGE, off, span)
    elif hugepages == "off":
        m.madvise(mmap.MADV_NOHUGEPAGE, off, span)
    return whole[off : off + nbytes].view(dtype)


def mappings() -> list[tuple[int, int, dict[str, str]]]:
    """This process's mappings from ``/proc/self/smaps``: ``(start, end, fields)``,
    ``fields`` the text after each ``Name:`` (``AnonHugePages``, ``VmFlags``...).

    Raises:
        OSError: the file cannot be read (not Linux).
    """
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    out: list[tuple[int, int, dict[str, str]]] = []
    for line in lines:
        head, _, rest = line.partition(" ")
        if head.endswith(":"):
            if out:
                out[-1][2][head[:-1]] = rest.strip()
            continue
        lo, _, hi = head.partition("-")
        try:
            out.append((int(lo, 16), int(hi, 16), {}))
        except ValueError:  # not a mapping's first line
            continue
    return out


def hugepage_fraction(*arrays: Any) -> float | None:
    """The fraction of the arrays' bytes that lie on huge pages (touch them first),
    or None where ``/proc/self/smaps`` cannot tell.

    Counted per mapping: ``AnonHugePages`` of each mapping, up to the bytes of the
    arrays in it.
    """
    spans = []
    for a in arrays:
        lo = int(a.__array_interface__["data"][0])
        spans.append((lo, lo + a.nbytes))
    total = sum(hi - lo for lo, hi in spans)
    if not total:
        return None
    try:
        maps = mappings()
    except OSError:
        return None
    huge = 0
    for vlo, vhi, fields in maps:
        overlap = sum(max(0, min(hi, vhi) - max(lo, vlo)) for lo, hi in spans)
        if overlap and "AnonHugePages" in fields:
            huge += min(overlap, int(fields["AnonHugePages"].split()[0]) * 1024)
    return huge / total
