"""torch's ``DistributedTest._DistTestBase`` as a test class for one backend,
as torch's ``test/distributed/test_distributed_spawn.py`` builds it.

Import it with ``BACKEND`` and ``WORLD_SIZE`` set (:mod:`.run` sets them): the
suite reads them when it is imported, and so does every process it spawns,
which imports this module again to find the class.  Each test spawns
``WORLD_SIZE`` processes that meet over a file store (``init_method=file://``)
and calls ``init_process_group(BACKEND, timeout=60 s)``.

A backend other than torch's own declares what it offers in
``DistTestCases.backend_feature``, whose sets gate the suite's tests:
``plugin`` (a registered third-party backend), ``ddp``, ``subgroup``, and
``gpu``/``cuda`` (CUDA tensors: pycoll stages them through host memory; on a
machine without GPUs the tests that need one skip themselves).  These must be
declared before the suite is imported, since its decorators read them then.
Tests gated on a backend by name (``BACKEND != "gloo"``, ``{"gloo"}``) skip
with that reason, unless ``TORCHSUITE_GATE=gloo``: then the suite is imported
as for Gloo (its decorators see ``BACKEND=gloo``, so the same tests run or
skip as for Gloo) and the tests run on ``BACKEND`` (the suite's module
global, which ``init_process_group`` takes, and ``os.environ``), so that a
test Gloo runs can be compared on pycoll.  A test that asks ``BACKEND ==
"gloo"`` while it runs sees the backend's own name.
"""

from __future__ import annotations

import os

import torch
from torch.testing._internal.common_distributed import DistTestCases

import pycoll.torch_backend

BACKEND = os.environ["BACKEND"]
#: What the pycoll backend declares to the suite (see the module docstring).
FEATURES = ("plugin", "ddp", "subgroup", "gpu", "cuda")

pycoll.torch_backend.register()
if BACKEND == pycoll.torch_backend.NAME:
    for feature in FEATURES:
        DistTestCases.backend_feature[feature].add(BACKEND)

torch.backends.cuda.matmul.allow_tf32 = False

GATE = os.environ.get("TORCHSUITE_GATE")  # the backend whose gates apply, if another
if GATE:
    os.environ["BACKEND"] = GATE

from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

if GATE:
    os.environ["BACKEND"] = BACKEND
    distributed_test.BACKEND = BACKEND


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """One test of the suite: ``WORLD_SIZE`` spawned processes run it."""

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()
