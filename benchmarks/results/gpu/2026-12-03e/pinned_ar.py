"""A prepared host allreduce on plain, torch-pinned and CuPy-pinned memory.

Run under mpiexec on the GPU machine; rank 0 prints the median time of a call
(after a barrier) for 1 and 25 MiB, in place and out of place.
"""

import time

import cupy
import numpy as np
import torch

import pycoll

comm = pycoll.init()
for nbytes in (1 << 20, 25 << 20):
    n = nbytes // 4
    kinds = {
        "numpy": np.ones(n, np.float32),
        "torch pinned": torch.ones(n, pin_memory=True).numpy(),
        "cupy pinned": np.frombuffer(cupy.cuda.alloc_pinned_memory(nbytes), np.float32, n),
    }
    for name, x in kinds.items():
        for inplace in (True, False):
            h = comm.prepare("allreduce", x, None if inplace else np.empty_like(x))
            for _ in range(3):
                h()
            ts = []
            for _ in range(15):
                comm.barrier()
                a = time.perf_counter()
                h()
                ts.append(time.perf_counter() - a)
            if comm.rank == 0:
                how = "in place" if inplace else "out of place"
                print(f"{nbytes >> 20:3d} MiB {name:13s} {how:12s} {np.median(ts) * 1e6:9.1f} us")
comm.close()
