"""Step time of data-parallel training: DDP over Gloo vs DDP over pycoll vs manual bucketing.

Run under MPI::

    mpiexec -n 2 python -m mpi4py examples/bench_ddp.py --steps 40 --batch 256 --bucket-mb 1

(``--device cuda``: models, data and gradients on GPU ``rank % GPUs``; Gloo
copies CUDA tensors to the host, pycoll keeps them on the device.)

All three train the same MLP as ``train_dp.py`` (same seed, same data shards,
same optimizer) in one job:

* ``ddp-gloo``: ``DistributedDataParallel`` on a Gloo process group;
* ``ddp-pycoll``: ``DistributedDataParallel`` on a ``pycoll`` process group
  (``pycoll.torch_backend``);
* ``manual``: ``train_dp.GradSync``, pycoll's allreduce called directly with
  ``async_op=True`` from per-parameter hooks;
* ``manual-blocking``: the same buckets, allreduced one by one after backward.

The modes run interleaved, a few steps at a time, so that a busy machine slows
them alike; rank 0 prints the median step time of each (and writes ``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_dp

MODES = ("ddp-gloo", "ddp-pycoll", "manual", "manual-blocking")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--chunk", type=int, default=5, help="steps per mode before switching")
    p.add_argument("--batch", type=int, default=256, help="global batch")
    p.add_argument("--bucket-mb", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--samples", type=int, default=8192)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: GPU rank %% GPUs"
    )
    p.add_argument("--json")
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    if cuda:  # before the groups: a pycoll communicator's device is the current one
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if "MASTER_PORT" not in os.environ:
        port = None
        if rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        os.environ["MASTER_PORT"] = str(world.bcast(port))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    import pycoll.torch_backend

    pycoll.torch_backend.register()
    dist.init_process_group("gloo", rank=rank, world_size=size)
    groups = {"ddp-gloo": dist.group.WORLD, "ddp-pycoll": dist.new_group(backend="pycoll")}
    comm = pycoll.init()

    x, y = train_dp.make_data(args.seed, args.samples, args.features, args.classes)
    x, y = x.to(dev), y.to(dev)
    loss_fn = nn.CrossEntropyLoss()
    bucket_bytes = int(args.bucket_mb * (1 << 20))
    runners: dict[str, Any] = {}
    for mode in modes:
        model = train_dp.build_model(
            args.seed, args.features, args.hidden, args.layers, args.classes
        ).to(dev)
        if mode.startswith("ddp"):
            net: nn.Module = DDP(
                model,
                device_ids=[dev.index] if cuda else None,
                process_group=groups[mode],
                bucket_cap_mb=args.bucket_mb,
            )
            sync = None
        else:
            net = model
            sync = train_dp.GradSync(comm, model, bucket_bytes, overlap=mode == "manual")
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        runners[mode] = (net, sync, opt)

    def step(mode: str, i: int) -> float:
        net, sync, opt = runners[mode]
        idx = torch.from_numpy(
            train_dp.shard(
                train_dp.global_batch(i, args.batch, args.samples, args.seed), rank, size
            )
        )
        t0 = time.perf_counter()
        if sync is None:
            opt.zero_grad()
        else:
            sync.zero_grad()
        loss_fn(net(x[idx]), y[idx]).backward()
        if sync is not None:
            sync.finish()
        opt.step()
        if cuda:
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {m: [] for m in modes}
    total = args.warmup + args.steps
    done = 0
    while done < total:
        k = min(args.chunk, total - done)
        for mode in modes:
            world.Barrier()
            for i in range(done, done + k):
                dt = step(mode, i)
                if i >= args.warmup:
                    times[mode].append(dt)
        done += k

    med = {m: statistics.median(t) for m, t in times.items()}
    # The slowest rank sets the pace: report the max over ranks of each median.
    med = {m: max(world.allgather(v)) for m, v in med.items()}
    nparams = sum(p.numel() for p in runners[modes[0]][0].parameters())
    if rank == 0:
        print(
            f"n={size} {args.device} params={nparams} batch={args.batch} bucket={args.bucket_mb} MiB "
            f"steps={args.steps} (median step time, max over ranks)"
        )
        base = med.get("ddp-gloo")
        for m in modes:
            rel = f"  {med[m] / base:.2f}x ddp-gloo" if base else ""
            print(f"  {m:16s} {1e3 * med[m]:8.2f} ms{rel}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {"n": size, "params": nparams, "args": vars(args), "step_s": med}, f, indent=1
                )
    world.Barrier()  # every rank done with its last collective before any closes
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
