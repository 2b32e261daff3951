"""Acquire/release 64-bit counters in shared memory.

Shared-memory flow control is the message-passing pattern: the producer writes
a slot's bytes, then *publishes* by storing a counter; the consumer *observes*
the counter, then reads the bytes.  That is correct only if the counter store is
a release (earlier writes become visible first) and the counter load an acquire
(later reads cannot be satisfied early).

* x86-64 is TSO: stores become visible in program order and loads are not
  reordered with older loads, so a plain aligned 8-byte store is a release and a
  plain aligned 8-byte load is an acquire.  The compiler cannot move numpy's
  memcpy across our load/store either: they are separate calls into opaque C.
  So on x86-64 we use a ctypes ``c_uint64`` view (one ``mov``, ~60 ns).
* Weakly ordered CPUs (aarch64, POWER, RISC-V) reorder stores with stores and
  loads with loads.  There we call libatomic's ``__atomic_store_8`` with
  ``__ATOMIC_RELEASE`` and ``__atomic_load_8`` with ``__ATOMIC_ACQUIRE`` (on
  aarch64: ``stlr``/``ldar``), which give exactly the two guarantees above (~400 ns).

The consumer's release of a slot (storing ``tail``) is a release too, so its
reads of the slot finish before the producer can observe the slot as free and
overwrite it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
from typing import Any

_ACQUIRE = 2
_RELEASE = 3
_TSO = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")

_lib: Any = None
if not _TSO:  # pragma: no cover - exercised on aarch64 only
    _name = ctypes.util.find_library("atomic") or "libatomic.so.1"
    try:
        _lib = ctypes.CDLL(_name)
        _lib.__atomic_load_8.restype = ctypes.c_uint64
        _lib.__atomic_load_8.argtypes = [ctypes.c_void_p, ctypes.c_int]
        _lib.__atomic_store_8.restype = None
        _lib.__atomic_store_8.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int]
    except OSError:
        _lib = None


def available() -> tuple[bool, str]:
    """Whether ordered counters are available on this CPU, and why."""
    if _TSO:
        return True, f"{platform.machine()} is TSO: plain aligned 8-byte loads/stores are ordered"
    if _lib is not None:
        return True, "libatomic acquire/release"
    return False, f"{platform.machine()} is weakly ordered and libatomic was not found"


class Counter:
    """A 64-bit counter at ``offset`` of a writable buffer (8-byte aligned)."""

    __slots__ = ("_addr", "_cell", "load", "store")

    def __init__(self, buf: Any, offset: int) -> None:
        if offset % 8:
            raise ValueError("counter offset must be 8-byte aligned")
        self._cell = ctypes.c_uint64.from_buffer(buf, offset)
        self._addr = ctypes.addressof(self._cell)
        if _TSO:
            cell = self._cell

            def load() -> int:
                return cell.value

            def store(value: int) -> None:
                cell.value = value
        else:  # pragma: no cover - aarch64
            if _lib is None:
                raise OSError(available()[1])
            addr, lib = self._addr, _lib

            def load() -> int:
                return int(lib.__atomic_load_8(addr, _ACQUIRE))

            def store(value: int) -> None:
                lib.__atomic_store_8(addr, value, _RELEASE)

        self.load = load
        self.store = store

    @property
    def address(self) -> int:
        """The counter's address in this process."""
        return self._addr

    def release_buffer(self) -> None:
        """Drop the buffer export so the mapping can be closed."""
        self._cell = None  # type: ignore[assignment]
        self.load = self.store = _closed  # type: ignore[assignment]


def _closed(*_: object) -> int:
    raise ValueError("counter's shared memory is closed")
