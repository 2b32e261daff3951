"""Where a prepared host allreduce loses time off the caller's thread.

The torch backend's worker thread runs DDP's bucket allreduces through pinned
host mirrors; there a 1 MiB allreduce took 230-630 us against 120-165 in a loop
(benchmarks/RESULTS.md, "The worker's host allreduce, four experiments").  This
times the same prepared call under one condition at a time:

* on the thread that made the communicator, or on a second thread;
* back to back, or with a 300 us sleep between calls (as buckets arrive);
* with the family's polite back-off on that thread, or the caller's;
* beside a third thread running Python 70 us of every 150 (DDP's hooks);
* with the GPU writing the pinned memory before each call (``--device cuda``).

Every rank stamps each call with ``time.perf_counter`` (CLOCK_MONOTONIC, one
clock for the host's processes), so besides each rank's own time it reports
the time once every rank is in (the last exit minus the last entry), which
leaves out the wait for a late peer.  Run under MPI::

    mpiexec -n 2 python benchmarks/worker_wait.py [--device cuda] [--calls 300]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

import numpy as np
from mpi4py import MPI

import pycoll

CONDITIONS: list[tuple[str, bool, dict[str, Any]]] = [
    # name, on a second thread, options
    ("first thread, back to back", False, {}),
    ("first thread, 300 us apart", False, {"gap": 300e-6}),
    ("second thread, back to back", True, {}),
    ("second thread, 300 us apart", True, {"gap": 300e-6}),
    ("second thread, 300 us apart, caller's back-off", True, {"gap": 300e-6, "eager": True}),
    ("second thread, back to back, caller's back-off", True, {"eager": True}),
    ("first thread, 300 us apart, GPU-written", False, {"gap": 300e-6, "fresh": True}),
    ("second thread, 300 us apart, GPU-written", True, {"gap": 300e-6, "fresh": True}),
    ("second thread, 300 us apart, beside Python", True, {"gap": 300e-6, "burn": True}),
    (
        "second thread, 300 us apart, beside Python, caller's back-off",
        True,
        {"gap": 300e-6, "burn": True, "eager": True},
    ),
    (
        "second thread, 300 us apart, beside Python, switch interval 100 us",
        True,
        {"gap": 300e-6, "burn": True, "switch": 1e-4},
    ),
]


def burner(stop: threading.Event) -> None:
    """Python for 70 us of every 150, holding the GIL as DDP's hooks do."""
    while not stop.is_set():
        until = time.perf_counter() + 70e-6
        while time.perf_counter() < until:
            pass
        time.sleep(80e-6)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=300, help="timed calls a condition")
    p.add_argument("--bytes", type=int, default=1 << 20)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    count, calls = args.bytes // 4, args.calls

    refresh = None
    if args.device == "cuda":  # pinned memory, as the backend's mirrors are
        import torch

        torch.cuda.set_device(rank % torch.cuda.device_count())
        host = torch.zeros(count, dtype=torch.float32, pin_memory=True)
        dev = torch.zeros(count, dtype=torch.float32, device="cuda")
        arr = host.numpy()

        def refresh() -> None:
            host.copy_(dev, non_blocking=True)
            torch.cuda.current_stream().synchronize()
    else:
        arr = np.zeros(count, np.float32)  # zeros: sums that never overflow

    comm = pycoll.init()
    polite = comm._engine.fam.polite  # the back-off of calls off the caller's thread
    caller = comm._engine.backoff  # ... and of the caller's, set on polite by "eager"
    eager = (caller.spins, caller.yields, caller.max_sleep)
    if rank == 0:
        print(
            f"# n = {size}, a prepared float32 allreduce of {args.bytes} bytes, {calls} calls a "
            f"condition, {args.device} memory; us, median; own: the slowest rank's own call; "
            "all in: the last exit minus the last entry; cpu: the thread's CPU time a call"
        )
        print(f"# {'condition':66s} {'own':>8s} {'all in':>8s} {'p90':>8s} {'cpu':>8s}")

    for name, threaded, o in CONDITIONS:
        if o.get("fresh") and refresh is None:
            continue
        t0, t1, cpu = np.zeros(calls), np.zeros(calls), np.zeros(calls)

        def body(o: dict[str, Any] = o, t0: Any = t0, t1: Any = t1, cpu: Any = cpu) -> None:
            saved = (polite.spins, polite.yields, polite.max_sleep)
            if o.get("eager"):
                polite.spins, polite.yields, polite.max_sleep = eager
            try:
                call = comm.prepare("allreduce", arr[:], op="sum")  # a new object: its own plan
                for _ in range(20):
                    call()
                world.Barrier()
                for i in range(calls):
                    if o.get("fresh"):
                        refresh()
                    if o.get("gap"):
                        time.sleep(o["gap"])
                    c = time.thread_time()
                    t0[i] = time.perf_counter()
                    call()
                    t1[i] = time.perf_counter()
                    cpu[i] = time.thread_time() - c
            finally:
                polite.spins, polite.yields, polite.max_sleep = saved

        interval = sys.getswitchinterval()
        if o.get("switch"):
            sys.setswitchinterval(o["switch"])
        stop = threading.Event()
        side = threading.Thread(target=burner, args=(stop,), daemon=True) if o.get("burn") else None
        if side is not None:
            side.start()
        world.Barrier()
        if threaded:
            th = threading.Thread(target=body)
            th.start()
            th.join()
        else:
            body()
        stop.set()
        if side is not None:
            side.join()
        sys.setswitchinterval(interval)
        T0, T1, C = (np.array(world.gather(a, root=0)) for a in (t0, t1, cpu))
        if rank == 0:
            own = np.median(T1 - T0, axis=1).max()
            all_in = T1.max(axis=0) - T0.max(axis=0)
            print(
                f"  {name:66s} {1e6 * own:8.1f} {1e6 * np.median(all_in):8.1f} "
                f"{1e6 * np.percentile(all_in, 90):8.1f} {1e6 * np.median(C, axis=1).max():8.1f}",
                flush=True,
            )
    comm.close()


if __name__ == "__main__":
    main()
