"""Cross-memory attach: read another process's memory in one kernel copy.

``process_vm_readv(2)`` copies straight from a peer's address space into ours,
so a large message costs one copy (by the receiver) instead of two (sender into
a shared slot, receiver out of it).  It needs the peer's pid in our pid
namespace and ptrace-level permission (same user, and no seccomp or Yama policy
against it), so the shm transport probes it once per connection and falls back
to slots when it fails.  ctypes releases the GIL during the call.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import os


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_readv = None
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _readv = _libc.process_vm_readv
    _readv.restype = ctypes.c_ssize_t
    _readv.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
except (OSError, AttributeError):  # pragma: no cover - not Linux/glibc
    _readv = None


def available() -> bool:
    return _readv is not None


def read(pid: int, remote: int, local: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``remote`` of process ``pid`` to ``local``.

    Raises:
        OSError: with the errno (ESRCH: the process is gone; EFAULT: bad range;
            EPERM: not allowed).
    """
    if _readv is None:
        raise OSError(_errno.ENOSYS, "process_vm_readv is not available")
    done = 0
    while done < nbytes:
        lv = _IOVec(local + done, nbytes - done)
        rv = _IOVec(remote + done, nbytes - done)
        got = _readv(pid, ctypes.byref(lv), 1, ctypes.byref(rv), 1, 0)
        if got < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        if got == 0:
            raise OSError(_errno.EFAULT, "process_vm_readv made no progress")
        done += got
