"""Host allreduce (prepared, pycoll) on plain, torch-pinned and cupy-pinned memory."""
import time, sys, numpy as np, torch, cupy
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
            o = None if inplace else np.empty_like(x)
            h = comm.prepare("allreduce", x, o)
            for _ in range(3): h()
            ts = []
            for _ in range(15):
                comm.barrier(); a = time.perf_counter(); h(); ts.append(time.perf_counter() - a)
            t = max(comm._dispatch.engine.boot.allgather(np.median(ts), 10, "t")) if False else np.median(ts)
            if comm.rank == 0:
                print(f"{nbytes >> 20:3d} MiB {name:13s} {'in place' if inplace else 'out of place':12s} {t * 1e6:9.1f} us", flush=True)
comm.close()
