"""Two small key-value stores for :func:`pycoll.init(store=...) <pycoll.init>`.

Both have the surface of torch's ``dist.Store`` that pycoll uses (``set``,
``get``, ``wait``, ``check``, ``add``), so anything written for one works with
the other.  Where torch is installed, its ``TCPStore`` serves ranks on several
hosts; these two need nothing beyond the standard library:

* :class:`HashStore`: ranks that are threads of one process.
* :class:`FileStore`: processes that share a directory (one host, or a shared
  file system); one file per key, written atomically.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
import urllib.parse
from collections.abc import Sequence
from datetime import timedelta

DEFAULT_TIMEOUT = timedelta(seconds=300)


def _seconds(timeout: timedelta | float | None, default: timedelta) -> float:
    t = default if timeout is None else timeout
    return t.total_seconds() if isinstance(t, timedelta) else float(t)


class HashStore:
    """An in-process store (thread-safe).

    Args:
        timeout: how long ``get`` and ``wait`` wait for a key by default.
    """

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        self.timeout = timeout
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: bytes | str) -> None:
        v = value.encode() if isinstance(value, str) else bytes(value)
        with self._cond:
            self._data[key] = v
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        self.wait([key])
        with self._cond:
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            n = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(n).encode()
            self._cond.notify_all()
            return n

    def check(self, keys: Sequence[str]) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)

    def wait(self, keys: Sequence[str], timeout: timedelta | float | None = None) -> None:
        """Return once every key is set.

        Raises:
            TimeoutError: ``timeout`` (default: the store's) passed first.
        """
        end = time.monotonic() + _seconds(timeout, self.timeout)
        with self._cond:
            while not all(k in self._data for k in keys):
                left = end - time.monotonic()
                if left <= 0:
                    missing = [k for k in keys if k not in self._data]
                    raise TimeoutError(f"HashStore: keys {missing} not set in time")
                self._cond.wait(left)

    def delete_key(self, key: str) -> bool:
        with self._cond:
            return self._data.pop(key, None) is not None


class FileStore:
    """A store in a directory that every rank can reach.

    Args:
        path: the directory (created if missing); remove it when the job is done.
        timeout: how long ``get`` and ``wait`` wait for a key by default.
    """

    def __init__(self, path: str | os.PathLike[str], timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        self.path = os.fspath(path)
        self.timeout = timeout
        os.makedirs(self.path, mode=0o700, exist_ok=True)

    def _file(self, key: str) -> str:
        return os.path.join(self.path, urllib.parse.quote(key, safe="") or "%")

    def set(self, key: str, value: bytes | str) -> None:
        v = value.encode() if isinstance(value, str) else bytes(value)
        dest = self._file(key)
        tmp = f"{dest}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(v)
        os.replace(tmp, dest)

    def get(self, key: str) -> bytes:
        self.wait([key])
        with open(self._file(key), "rb") as f:
            return f.read()

    def add(self, key: str, amount: int) -> int:
        with open(os.path.join(self.path, ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                with open(self._file(key), "rb") as f:
                    n = int(f.read() or b"0")
            except FileNotFoundError:
                n = 0
            n += amount
            self.set(key, str(n))
            return n

    def check(self, keys: Sequence[str]) -> bool:
        return all(os.path.exists(self._file(k)) for k in keys)

    def wait(self, keys: Sequence[str], timeout: timedelta | float | None = None) -> None:
        """Return once every key is set (polled with growing naps up to 10 ms).

        Raises:
            TimeoutError: ``timeout`` (default: the store's) passed first.
        """
        end = time.monotonic() + _seconds(timeout, self.timeout)
        nap = 1e-4
        while not self.check(keys):
            if time.monotonic() >= end:
                missing = [k for k in keys if not os.path.exists(self._file(k))]
                raise TimeoutError(f"FileStore {self.path}: keys {missing} not set in time")
            time.sleep(nap)
            nap = min(2 * nap, 0.01)

    def delete_key(self, key: str) -> bool:
        try:
            os.unlink(self._file(key))
        except FileNotFoundError:
            return False
        return True
