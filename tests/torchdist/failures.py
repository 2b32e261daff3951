"""One failure of the torch backend per run, on every rank; each rank writes its outcome as JSON.

Run under ``mpiexec -disable-auto-cleanup -n 2 python tests/torchdist/failures.py
NAME OUTDIR`` (tests/test_torch_backend.py does).  Every case must end in an
exception on the surviving ranks, within the timeout, through ``dist.*``'s
synchronous calls, ``work.wait()`` or ``work.get_future().wait()``; a rank
that returns instead reports ``"error": null`` and the test fails.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pycoll.torch_backend

NAME, OUTDIR = sys.argv[1], sys.argv[2]
WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
#: the timeout given to init_process_group (the cases that wait for a peer use it)
TIMEOUT = float(os.environ.get("FAILURES_TIMEOUT", "4"))
# The launcher stops forwarding output once a rank dies: log to a file instead.
signal.signal(signal.SIGPIPE, signal.SIG_IGN)
_log = os.open(os.path.join(OUTDIR, f"rank{RANK}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
os.dup2(_log, 2)
os.close(_log)
faulthandler.enable()  # a SIGABRT from the test writes every thread's stack to the log
Path(OUTDIR, f"rank{RANK}.pid").write_text(str(os.getpid()))


def report(**kw: object) -> None:
    path = os.path.join(OUTDIR, f"rank{RANK}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(kw, f)
    os.replace(path + ".tmp", path)


def outcome(fn, *, then=None) -> dict[str, object]:
    """Run ``fn``; what it raised (or returned), and how long it took."""
    start = time.monotonic()
    d: dict[str, object] = {"error": None}
    try:
        d["returned"] = repr(fn())
    except Exception as exc:
        traceback.print_exc()
        d.update(
            error=type(exc).__name__,
            message=str(exc),
            runtime_error=isinstance(exc, RuntimeError),
            pycoll_error=isinstance(exc, pycoll.PycollError),
        )
    d["elapsed"] = time.monotonic() - start
    if then is not None:  # the next call on the same group
        d["then"] = outcome(then)
    return d


def init(**kw: object) -> None:
    pycoll.torch_backend.register()
    kw.setdefault("timeout", timedelta(seconds=TIMEOUT))
    dist.init_process_group("pycoll", rank=RANK, world_size=SIZE, **kw)
    dist.all_reduce(torch.ones(3))  # the group works


def finish(res: dict[str, object], survivors: range | list[int]) -> None:
    """Report, wait for the other survivors' reports, then leave without MPI_Finalize
    (which would wait for a dead rank)."""
    report(**res)
    end = time.monotonic() + 60
    while time.monotonic() < end and not all(
        os.path.exists(os.path.join(OUTDIR, f"rank{r}.json")) for r in survivors
    ):
        time.sleep(0.05)
    os._exit(0)


def mismatch(make) -> None:
    init()
    t = make()
    res = outcome(lambda: dist.all_reduce(t), then=lambda: dist.all_reduce(torch.ones(3)))
    res["value"] = t.tolist()
    finish(res, range(SIZE))


def missing(how: str) -> None:
    """Rank 1 never calls the collective; rank 0 must raise within the timeout."""
    if how == "env":  # PYCOLL_TIMEOUT (set by the test) with torch's default timeout
        init(timeout=None)
        dist.all_reduce(torch.ones(3))
    else:
        init()
    if RANK == 1:  # away until rank 0 has reported
        end = time.monotonic() + TIMEOUT * 4 + 15
        while time.monotonic() < end and not os.path.exists(os.path.join(OUTDIR, "rank0.json")):
            time.sleep(0.1)
        finish({"error": None, "sleeper": True}, [0, 1])
    t = torch.ones(4)
    if how in ("sync", "env"):
        res = outcome(lambda: dist.all_reduce(t))
    elif how == "wait":
        work = dist.all_reduce(t, async_op=True)
        res = outcome(lambda: work.wait())
        res["is_completed"] = work.is_completed()
    elif how == "wait-timeout":  # wait(timeout) shorter than the group's timeout
        work = dist.all_reduce(t, async_op=True)
        res = outcome(lambda: work.wait(timedelta(seconds=1)))
    elif how == "future":
        work = dist.all_reduce(t, async_op=True)
        res = outcome(lambda: work.get_future().wait())
    elif how == "barrier":
        res = outcome(lambda: dist.barrier())
    elif how == "monitored":
        res = outcome(lambda: pycoll.torch_backend.monitored_barrier(timeout=timedelta(seconds=2)))
    res["value"] = t.tolist()
    finish(res, [0, 1])


def exits() -> None:
    """Rank 1 exits after the first collective; rank 0's next ones raise."""
    init()
    WORLD.Barrier()
    if RANK == 1:
        os._exit(0)
    time.sleep(0.5)
    t = torch.ones(4)
    res = outcome(lambda: dist.all_reduce(t), then=lambda: dist.all_reduce(torch.ones(3)))
    res["value"] = t.tolist()
    start = time.monotonic()
    dist.destroy_process_group()  # waits for no dead peer
    res["destroy_s"] = time.monotonic() - start
    finish(res, [0])


def ddp_dies() -> None:
    """Rank 1 is killed in the middle of a DDP backward; rank 0's step must raise."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.Linear(256, 4))
    ddp = DDP(model, bucket_cap_mb=0.05)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(16, 64)
    y = torch.randint(0, 4, (16,))

    def step() -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    WORLD.Barrier()
    if RANK == 1:
        # die once the first bucket's allreduce has been issued
        model[0].weight.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
        step()
        time.sleep(30)

    def steps() -> None:
        for _ in range(1000):
            step()

    finish(outcome(steps), [0])


{
    "count": lambda: mismatch(lambda: torch.ones(4 if RANK == 0 else 6)),
    "dtype": lambda: mismatch(
        lambda: torch.ones(4, dtype=torch.float32 if RANK == 0 else torch.float64)
    ),
    "missing": lambda: missing("sync"),
    "missing-env": lambda: missing("env"),
    "missing-wait": lambda: missing("wait"),
    "missing-future": lambda: missing("future"),
    "missing-wait-timeout": lambda: missing("wait-timeout"),
    "missing-barrier": lambda: missing("barrier"),
    "missing-monitored": lambda: missing("monitored"),
    "exits": exits,
    "ddp-dies": ddp_dies,
}[NAME]()
