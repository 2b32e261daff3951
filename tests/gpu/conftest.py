"""GPU tests: skipped, with the reason, where CuPy or a CUDA device is missing.

Plain ``pytest`` does not even collect this folder (``norecursedirs``);
``tests/gpu/run_on_device.sh`` runs it on a GPU machine, at n = 1 without a
launcher and at n = 2, 3, 4 under mpiexec.
"""

from __future__ import annotations

import importlib.util

import pytest


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
