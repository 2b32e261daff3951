"""What same-host transports share: who can share memory, and segments without names.

A segment (the ring of a pair of ranks, the group segment, a shared send
buffer, the cuda_ipc control page) is born without a name: an ``O_TMPFILE``
file in ``/dev/shm``'s filesystem (mode 0600; a ``memfd`` where that is not
supported), so it counts against /dev/shm's size as a named file would but can
never be left behind.  Its creator keeps a descriptor of it (the *handle*) and
each peer opens that descriptor as ``/proc/<creator pid>/fd/<handle>``, which
takes a new reference to the same memory.

The rule: **no moment of set-up gives a segment a name**, so a kill at any
instant (of one rank, or of all of them by the launcher) leaks nothing: the
kernel frees a segment when the last process holding a descriptor or a mapping
of it is gone.  The cost: peers must share a pid namespace
(:func:`shared_memory_verdict` refuses others, which then use a network
transport).

How a peer learns a handle: the group segment's travels with the bootstrap
(:attr:`transports.shm_group.ShmGroup.handle`); a shared send buffer's is
written into its pair segment.  For pair segments each rank makes one small
:class:`Directory` before it publishes its endpoint blob, which carries the
directory's descriptor: the creator of a pair segment, once the segment is
complete, stores the handle in the peer's entry there (release), and the peer
waits for it (:func:`find`), watching that the creator is alive.  A descriptor
number is reused once its file is closed, so every segment carries a 16-byte
identity at :data:`IDENT_OFF` (the creator's token and the pair), checked with
its magic word before anything in it is trusted.  Used by
:mod:`transports.shm`, :mod:`transports.shm_group` and :mod:`transports.cuda_ipc`.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import struct
import time
from collections.abc import Callable
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
    pid_ns: int
    shm_dev: int


def shared_memory_verdict(a: HostIdentity, b: HostIdentity) -> tuple[bool, str]:
    """Whether two ranks can share memory: same kernel boot, IPC namespace, /dev/shm
    and pid namespace (segments pass through /proc: see the module docstring).

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
    if a.pid_ns != b.pid_ns:
        return False, "different pid namespace (segments pass between ranks through /proc/<pid>/fd)"
    return True, f"same host, IPC namespace and {SHM_DIR}"


#: Where every segment keeps its 16-byte identity (after its magic and header).
IDENT_OFF = 32
_DIR_MAGIC = 0x70636F6C6C646972  # "pcolldir"
_DIR_ENTRIES = 64  # the directory's entry of rank r: 8 bytes at 64 + 8 r


def _ident(ident: bytes) -> bytes:
    return ident.ljust(16, b"\0")[:16]


def create(
    size: int, *, ident: bytes, peer: int, transport: str, hint: str = ""
) -> tuple[mmap.mmap, int]:
    """Create a nameless segment of ``size`` bytes (0600, pages reserved), map it
    and write ``ident`` at :data:`IDENT_OFF`; return the mapping and the handle.

    The caller writes its header and then its magic word at offset 0, last, and
    keeps the handle open until every peer has opened it.

    Raises:
        ConnectError: /dev/shm lacks the room (the message names the size asked
            for, the space free and ``hint``), or the file cannot be created.
    """
    free = free_bytes()
    what = f"{transport} segment" + (f" for peer {peer}" if peer >= 0 else "")
    if size > free:
        raise ConnectError(
            f"{what} needs {size} bytes but {SHM_DIR} has only {free} free; {hint}".rstrip("; "),
            peer=peer,
            transport=transport,
            errno=errno.ENOSPC,
        )
    try:
        fd = os.open(SHM_DIR, os.O_RDWR | os.O_TMPFILE, 0o600)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise ConnectError(
                f"{what}: cannot create a file in {SHM_DIR}: {exc.strerror}",
                peer=peer,
                transport=transport,
                errno=exc.errno,
            ) from exc
        fd = os.memfd_create("pycoll", os.MFD_CLOEXEC)  # no O_TMPFILE on this filesystem
    try:
        # Reserve the pages now: a tmpfs that runs out later kills us with SIGBUS.
        os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size)
    except OSError as exc:
        os.close(fd)
        raise ConnectError(
            f"{what} needs {size} bytes in {SHM_DIR} ({free} free): {exc.strerror}; {hint}".rstrip(
                "; "
            ),
            peer=peer,
            transport=transport,
            errno=exc.errno,
        ) from exc
    mm[IDENT_OFF : IDENT_OFF + 16] = _ident(ident)
    return mm, fd


def attach(
    pid: int, handle: int, *, magic: int, ident: bytes, min_size: int, peer: int, transport: str
) -> mmap.mmap:
    """Map the segment that process ``pid`` holds as descriptor ``handle``.

    Raises:
        ConnectError: it cannot be opened (its creator is gone, or /proc refuses),
            or it is not the segment that ``magic`` and ``ident`` name.
    """
    path = f"/proc/{pid}/fd/{handle}"
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        gone = " (it has exited)" if process_gone(pid) else ""
        raise ConnectError(
            f"{transport}: cannot open rank {peer}'s segment {path}{gone}: {exc.strerror}",
            peer=peer,
            transport=transport,
            errno=exc.errno,
        ) from exc
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 0 and st.st_size >= max(min_size, 64):
            mm = mmap.mmap(fd, st.st_size)
            if struct.unpack_from("<Q", mm, 0)[0] == magic and mm[
                IDENT_OFF : IDENT_OFF + 16
            ] == _ident(ident):
                return mm
            mm.close()
    finally:
        os.close(fd)
    raise ConnectError(
        f"{transport}: {path} is not the segment rank {peer} made for us",
        peer=peer,
        transport=transport,
    )


def probe_room(size: int, *, transport: str, hint: str = "") -> None:
    """Create and reserve a segment of ``size`` bytes, then drop it: whether
    :func:`create` can succeed now (a full /dev/shm fails here, at once).

    Raises:
        ConnectError: as :func:`create` (``errno`` ENOSPC when the room is lacking).
    """
    mm, fd = create(size, ident=b"probe", peer=-1, transport=transport, hint=hint)
    mm.close()
    os.close(fd)


class Directory:
    """Where a rank publishes the handles of the pair segments it creates (see the
    module docstring): a nameless page with an entry per rank, made before the
    rank's endpoint blob is published; the blob carries :attr:`fd`."""

    def __init__(self, size: int, token: bytes, transport: str) -> None:
        self.mm, self.fd = create(
            _DIR_ENTRIES + 8 * size, ident=token, peer=-1, transport=transport
        )
        self._entries = [_atomic.Counter(self.mm, _DIR_ENTRIES + 8 * r) for r in range(size)]
        struct.pack_into("<Q", self.mm, 0, _DIR_MAGIC)

    def publish(self, rank: int, handle: int) -> None:
        """Rank ``rank``'s segment is complete; this process holds it as ``handle``."""
        self._entries[rank].store(handle + 1)

    def close(self) -> None:
        for c in self._entries:
            c.release_buffer()
        self._entries = []
        try:
            self.mm.close()
        except BufferError:
            pass
        os.close(self.fd)


def find(
    pid: int,
    dirfd: int,
    token: bytes,
    me: int,
    *,
    peer: int,
    transport: str,
    deadline: Deadline,
    timeout: float,
) -> int:
    """Wait until rank ``peer`` (process ``pid``, directory ``dirfd``, ``token``)
    has published the handle of the segment it makes for rank ``me``; return it.

    Raises:
        ConnectError: the directory cannot be opened, the peer exited, or the
            handle did not come before ``deadline``.
    """
    mm = attach(
        pid,
        dirfd,
        magic=_DIR_MAGIC,
        ident=token,
        min_size=_DIR_ENTRIES + 8 * (me + 1),
        peer=peer,
        transport=transport,
    )
    entry = _atomic.Counter(mm, _DIR_ENTRIES + 8 * me)
    try:
        bo = Backoff(spins=0, yields=16)
        n = 0
        while not (v := entry.load()):
            n += 1
            if deadline.expired():
                raise ConnectError(
                    f"{transport}: rank {peer} made no segment for us within {timeout:g} s",
                    peer=peer,
                    transport=transport,
                )
            if n % 64 == 0 and process_gone(pid):
                raise ConnectError(
                    f"{transport}: rank {peer} (pid {pid}) exited before it made our segment",
                    peer=peer,
                    transport=transport,
                )
            bo.pause()
        return int(v) - 1
    finally:
        entry.release_buffer()
        mm.close()


#: A side's "closed" word in a shared-memory segment: 0 while open, CLOSED once
#: closed, and ``BECAUSE + r`` once closed because rank r failed (one store, so a
#: reader sees the reason with the flag or not at all).
CLOSED = 1
BECAUSE = 2


def closed_word(cause: int | None) -> int:
    """The "closed" word to store: closed, and why (``cause``: the rank that failed)."""
    return CLOSED if cause is None else BECAUSE + cause


def check_alive(
    closed: _atomic.Counter,
    pid: int,
    who: str,
    *,
    peer: int,
    transport: str,
    there: Callable[[], bool] | None = None,
) -> None:
    """The liveness check of every shared-memory peer (shm, shm_group, cuda_ipc).

    ``closed`` is the peer's "closed" word in the segment (set by its close(), or
    by :mod:`transports._exit` when it exits without one; see :func:`closed_word`);
    ``pid`` its pid in our pid namespace (0: unknown), which tells a killed peer apart.
    ``there()``: whether what the caller waits for from the peer has come.  A
    peer that stored it and then closed or exited between the caller's last look
    and this check is not gone for that wait: once we have seen it closed (or
    gone), we see what it stored before, so ``there()`` is asked then, and
    nothing is raised where it says yes.

    Raises:
        PeerClosedError: the peer closed its end (``cause_rank``: the rank it
            closed because of, if it said) or has exited; the message starts
            with ``who`` ("shm: peer 3").
    """
    word = closed.load()
    if word:
        if there is not None and there():
            return
        cause = word - BECAUSE if word >= BECAUSE else None
        why = "" if cause is None else f" because rank {cause} failed"
        raise PeerClosedError(
            f"{who} closed its connection{why}", peer=peer, transport=transport, cause_rank=cause
        )
    if pid and _pid_check_due(pid) and process_gone(pid):
        if there is not None and there():
            return
        raise PeerClosedError(f"{who} (pid {pid}) has exited", peer=peer, transport=transport)


#: :func:`check_alive` looks a peer's pid up at most this often (seconds): the
#: lookup (``kill(pid, 0)`` and reading ``/proc/<pid>/stat``) took 35-70 us on
#: the 2-core VM, and a wait that ran into it noticed its message that much
#: later (a 4 MiB point-to-point message, whose sender waits about 130 us for
#: the receiver's read, paid one nearly every time).  A peer's own close, or
#: its exit through :mod:`transports._exit`, is seen at every check.
PID_CHECK_SECONDS = 0.005
_pid_checked: dict[int, float] = {}


def _pid_check_due(pid: int) -> bool:
    now = time.monotonic()
    last = _pid_checked.get(pid)
    if last is not None and now - last < PID_CHECK_SECONDS:
        return False
    if len(_pid_checked) >= 1024:  # (pids of peers long gone)
        _pid_checked.clear()
    _pid_checked[pid] = now
    return True


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
    # the state follows the command name, which sits in parentheses and may hold
    # any byte; the flags are the 7th field after it.  A process that has begun to
    # exit (PF_EXITING) runs no more of its code: it is gone for its peers, also
    # while its exit waits in the kernel (on an H100, the exit of a process whose
    # device memory another process's stream waited on did not end)
    fields = stat[stat.rfind(b")") + 2 :].split()
    if not fields or fields[0] in (b"Z", b"X"):
        return True
    try:
        return bool(int(fields[6]) & _PF_EXITING)
    except (IndexError, ValueError):
        return False


_PF_EXITING = 0x4  # include/linux/sched.h
