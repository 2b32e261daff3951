"""What same-host transports share: who can share memory, and pair segments.

A pair of ranks on one host meets in a segment under ``/dev/shm`` named
``pycoll-...`` (mode 0600): the lower rank creates it, reserves its pages and
writes a magic word last; the higher rank waits for the magic, attaches and
unlinks it, so nothing outlives the job.  Used by :mod:`transports.shm` and
:mod:`transports.cuda_ipc`.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Protocol

from transports import _atomic
from transports.base import Backoff, ConnectError, Deadline, PeerClosedError

SHM_DIR = "/dev/shm"
NO_BOOT = b"\0" * 16


def boot_id() -> bytes:
    """This kernel boot's id (16 bytes), or zeros when it cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            h = f.read().strip().replace("-", "")
        return bytes.fromhex(h) if len(h) == 32 else NO_BOOT
    except (OSError, ValueError):
        return NO_BOOT


def ns_inode(kind: str) -> int:
    """The inode of this process's namespace of ``kind`` ("ipc", "pid"...), or 0."""
    try:
        return os.stat(f"/proc/self/ns/{kind}").st_ino
    except OSError:
        return 0


def shm_device() -> int:
    """The device number of the ``/dev/shm`` filesystem instance, or 0."""
    try:
        return os.stat(SHM_DIR).st_dev
    except OSError:
        return 0


def free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


class HostIdentity(Protocol):
    boot: bytes
    ipc_ns: int
    shm_dev: int


def shared_memory_verdict(a: HostIdentity, b: HostIdentity) -> tuple[bool, str]:
    """Whether two ranks can share memory: same kernel boot, IPC namespace and /dev/shm.

    Containers on one machine with their own IPC namespace or their own /dev/shm
    (and simulated hosts) fail one of these and fall back to a network transport.
    """
    if not os.path.isdir(SHM_DIR):
        return False, f"{SHM_DIR} does not exist"
    if a.boot != b.boot or a.boot == NO_BOOT:
        return False, "different kernel boot (another host)"
    if a.ipc_ns != b.ipc_ns:
        return False, "different IPC namespace (another container or simulated host)"
    if a.shm_dev != b.shm_dev:
        return False, f"different {SHM_DIR} filesystem"
    return True, f"same host, IPC namespace and {SHM_DIR}"


def create(name: str, size: int, *, peer: int, transport: str, hint: str = "") -> mmap.mmap:
    """Create segment ``name`` of ``size`` bytes (0600, pages reserved) and map it.

    The caller writes its header and then the magic word at offset 0, last.

    Raises:
        ConnectError: /dev/shm lacks the room (the message names the size asked
            for, the space free and ``hint``), or the file cannot be created.
    """
    path = os.path.join(SHM_DIR, name)
    free = free_bytes()
    what = f"{transport} segment for peer {peer}"
    if size > free:
        raise ConnectError(
            f"{what} needs {size} bytes but {SHM_DIR} has only {free} free; {hint}".rstrip("; "),
            peer=peer,
            transport=transport,
        )
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise ConnectError(
            f"{what}: cannot create {path}: {exc.strerror}",
            peer=peer,
            transport=transport,
            errno=exc.errno,
        ) from exc
    try:
        try:
            # Reserve the pages now: a tmpfs that runs out later kills us with SIGBUS.
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.unlink(path)
            raise ConnectError(
                f"{what} needs {size} bytes in {SHM_DIR} ({free} free): {exc.strerror}; {hint}".rstrip(
                    "; "
                ),
                peer=peer,
                transport=transport,
                errno=exc.errno,
            ) from exc
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def attach(
    name: str,
    *,
    magic: int,
    min_size: int,
    peer: int,
    transport: str,
    deadline: Deadline,
    timeout: float,
) -> mmap.mmap:
    """Wait for segment ``name`` to exist with its magic word set, then map it.

    Raises:
        ConnectError: it did not appear before ``deadline``.
    """
    path = os.path.join(SHM_DIR, name)
    bo = Backoff(spins=0, yields=16)
    while True:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            fd = -1
        if fd >= 0:
            try:
                size = os.fstat(fd).st_size
                if size >= min_size:
                    mm = mmap.mmap(fd, size)
                    if struct.unpack_from("<Q", mm, 0)[0] == magic:
                        return mm
                    mm.close()
            finally:
                os.close(fd)
        if deadline.expired():
            raise ConnectError(
                f"{transport}: segment {name} from rank {peer} never appeared within {timeout:g} s",
                peer=peer,
                transport=transport,
            )
        bo.pause()


def unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def check_alive(closed: _atomic.Counter, pid: int, who: str, *, peer: int, transport: str) -> None:
    """The liveness check of every shared-memory peer (shm, shm_group, cuda_ipc).

    ``closed`` is the peer's "closed" flag in the segment (set by its close(), or
    by :mod:`transports._exit` when it exits without one); ``pid`` its pid in our
    pid namespace (0: unknown), which tells a killed peer apart.

    Raises:
        PeerClosedError: the peer closed its end or has exited; the message
            starts with ``who`` ("shm: peer 3").
    """
    if closed.load():
        raise PeerClosedError(f"{who} closed its connection", peer=peer, transport=transport)
    if pid and process_gone(pid):
        raise PeerClosedError(f"{who} (pid {pid}) has exited", peer=peer, transport=transport)


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (or is a zombie its launcher has not reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    # the state follows the command name, which sits in parentheses and may hold any byte
    end = stat.rfind(b")")
    return stat[end + 2 : end + 3] in (b"Z", b"X")
