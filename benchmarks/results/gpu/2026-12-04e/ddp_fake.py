"""bench_ddp with the mirrored bucket's host allreduce replaced by a GIL-free
spin of FAKE_AR_US microseconds (results wrong: a timing probe only; -1: the
real allreduce).  From the repository root, on the GPU machine:

    gcc -O2 -shared -fPIC benchmarks/results/gpu/2026-12-04e/spin.c -o /tmp/spin.so
    FAKE_AR_US=150 mpiexec -n 2 python -m mpi4py benchmarks/results/gpu/2026-12-04e/ddp_fake.py \\
        --device cuda --steps 80 --modes ddp-gloo,ddp-pycoll
"""

from __future__ import annotations

import ctypes
import os
import runpy
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.getcwd(), "examples"))
T = float(os.environ.get("FAKE_AR_US", "-1"))
if T >= 0:
    lib = ctypes.CDLL(os.environ.get("SPIN_SO", "/tmp/spin.so"))  # a CDLL call releases the GIL
    lib.spin_us.argtypes = [ctypes.c_double]
    from pycoll.torch_backend import mirrors

    def reduce(self: Any, m: Any, flat: Any, op: str, stream: int) -> None:
        try:
            cu = self._cu
            self._wait(cu, m.copied)
            if T > 0:
                lib.spin_us(T)
            cu.copy(flat.data_ptr(), m.addr, flat.nbytes, stream)
            cu.record(m.copied, stream)
        finally:
            self._give(m)

    mirrors.Mirrors.reduce = reduce  # type: ignore[method-assign]
sys.argv = ["examples/bench_ddp.py", *sys.argv[1:]]
runpy.run_path("examples/bench_ddp.py", run_name="__main__")
