"""The pinned mirrors of a device call through the host keep the caller's aliasing.

Runs without a GPU: :meth:`GpuContext._host_views` is called on stand-ins for
device buffers (an address and a size), with host memory for the mirrors.  On
the H200 an in-place allgather at n = 4 (sendbuf is block r of recvbuf) came
back with block r stale on ranks 1-3, because input and output had two mirrors
while the host collective's envelope skipped the own block.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from pycoll.buffers import Buffer
from pycoll.gpu.context import GpuContext

BASE = 1 << 40  # a stand-in device address


def _dev(offset: int, count: int) -> Buffer:
    flat = SimpleNamespace(
        data=SimpleNamespace(ptr=BASE + offset), nbytes=4 * count, size=count, dtype=np.dtype("f4")
    )
    return Buffer(flat, flat, 0)


def _ctx() -> Any:
    mirrors: dict[int, np.ndarray] = {}

    def mirror(slot: int, nbytes: int) -> tuple[int, np.ndarray]:
        if slot not in mirrors or len(mirrors[slot]) < nbytes:
            mirrors[slot] = np.zeros(nbytes, np.uint8)
        h = mirrors[slot]
        return int(h.__array_interface__["data"][0]), h

    return SimpleNamespace(_mirror=mirror)


def _addr(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


@pytest.mark.parametrize("r", [0, 1, 3])
def test_an_input_inside_the_output_is_that_block_of_its_mirror(r: int) -> None:
    k, n = 5, 4
    x, out = _dev(4 * k * r, k), _dev(0, n * k)
    hptr, hv, optr, ov = GpuContext._host_views(_ctx(), x, out)
    assert ov is not None and ov.size == n * k and hv.size == k
    assert _addr(hv) == _addr(ov) + 4 * k * r and hptr == _addr(hv) and optr == _addr(ov)


def test_an_output_inside_the_input_is_that_block_of_its_mirror() -> None:
    x, out = _dev(0, 12), _dev(8, 3)  # reduce_scatter in place: out is block 2 of x
    hptr, hv, optr, ov = GpuContext._host_views(_ctx(), x, out)
    assert ov is not None and _addr(ov) == _addr(hv) + 8 and (hptr, optr) == (_addr(hv), _addr(ov))


def test_separate_buffers_get_separate_mirrors() -> None:
    x, out = _dev(0, 4), _dev(4096, 16)
    hptr, hv, optr, ov = GpuContext._host_views(_ctx(), x, out)
    assert ov is not None and not np.shares_memory(hv, ov)
    assert (hptr, optr) == (_addr(hv), _addr(ov))
