"""A rank that opens a peer's window checks the sizes the peer exposed.

Runs without a GPU: :meth:`Windows.open` is called on a stand-in whose
connection hands out exposed spans, as cuda_ipc's ``open_window`` does.  On the
H200 at n = 3 and 4, a broadcast of 12 bytes on two ranks and 24 on the root
returned the root's first 12 bytes with no error, before this check.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from pycoll.gpu.windows import Windows
from transports.base import DeviceSpan, TagMismatchError


def _windows(*sizes: int) -> Any:
    spans = [DeviceSpan(1 << 40, n, 0, 0) for n in sizes]
    conn = SimpleNamespace(open_window=lambda stream, deadline: spans)
    return SimpleNamespace(
        conns={1: conn},
        _sptr=0,
        deadline=None,
        _as_array=lambda ptr, nbytes, dtype, device: np.zeros(nbytes // dtype.itemsize, dtype),
    )


F4 = np.dtype(np.float32)


def test_matching_sizes_open() -> None:
    assert [a.size for a in Windows.open(_windows(12), 1, F4, 12)] == [3]
    assert [a.size for a in Windows.open(_windows(12, 48), 1, F4, 12, 48)] == [3, 12]
    assert [a.size for a in Windows.open(_windows(12), 1, F4, 12, 12)] == [3]  # in place


@pytest.mark.parametrize(
    "exposed,first,last",
    [((12,), 24, None), ((24,), 12, None), ((12, 48), 12, 24), ((12, 24), 24, 24), ((), 12, None)],
)
def test_other_sizes_raise_a_mismatch_naming_the_peer(
    exposed: tuple[int, ...], first: int, last: int | None
) -> None:
    with pytest.raises(TagMismatchError, match="rank 1 exposed buffers of") as info:
        Windows.open(_windows(*exposed), 1, F4, first, last)
    assert info.value.peer == 1
