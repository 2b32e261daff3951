"""GPU tests: skipped, with the reason, where CuPy or a CUDA device is missing.

Plain ``pytest`` does not even collect this folder (``norecursedirs``);
``tests/gpu/run_on_device.sh`` runs it on a GPU machine, at n = 1 without a
launcher and at n = 2, 3, 4 under mpiexec.
"""

from __future__ import annotations

import importlib.util

import pytest

import pycoll


def _gpu() -> tuple[bool, str]:
    if importlib.util.find_spec("cupy") is None:
        return False, "CuPy is not installed"
    try:
        import cupy

        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:
        return False, f"no usable CUDA device ({type(exc).__name__}: {exc})"
    return (n > 0), "no CUDA device"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ok, why = _gpu()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {why}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Communicators per path, one of each per test module (each module's autouse
# ``_device`` fixture makes the rank's GPU current first).


@pytest.fixture(scope="module")
def comm(_device):
    c = pycoll.init(timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def comm_host(_device):
    """The host path for every small message: explicit limits are obeyed as they are,
    also on a GPU the ranks share (where auto's default keeps small copies off it)."""
    c = pycoll.init(timeout=120, device_host_bytes=128 << 10)
    yield c
    c.close()


@pytest.fixture(scope="module")
def comm_staged(_device):
    c = pycoll.init(timeout=120, device_transports=(), device_chunk_bytes=256 << 10)
    yield c
    c.close()


@pytest.fixture(scope="module")
def comm_tcp(_device):
    c = pycoll.init(timeout=120, transports=("tcp",), device_transports=())
    yield c
    c.close()


@pytest.fixture
def replays(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``replays[0]``: how many calls of the test ran as replays of a device plan
    (pycoll/gpu/replay.py) on this rank."""
    from pycoll.gpu import replay

    seen = [0]
    run = replay.DevicePlan.run

    def counted(self, sendbuf, recvbuf):  # type: ignore[no-untyped-def]
        seen[0] += 1
        return run(self, sendbuf, recvbuf)

    monkeypatch.setattr(replay.DevicePlan, "run", counted)
    return seen
