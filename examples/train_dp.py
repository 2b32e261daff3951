"""Data-parallel training with pycoll: bucketed, overlapped gradient allreduce.

Run under MPI::

    mpiexec -n 4 python -m mpi4py examples/train_dp.py --steps 50 --batch 256 --bucket-mb 1

With ``--device cuda`` the model, the data and the buckets live on GPU
``rank % GPUs``, and the bucket allreduces run on pycoll's device path: each is
queued after the backward work on the current stream, and ``wait()`` makes that
stream wait for it (ranks may share one GPU).

Every rank holds a replica of a small MLP classifier and trains it on its own
shard of each global batch.  Gradients are synchronised the way DDP and
Horovod's tensor fusion do it:

* Parameters are grouped into buckets of about ``--bucket-mb`` MiB, in reverse
  registration order (roughly the order in which backward produces their
  gradients).  Each bucket is one flat float32 tensor and every parameter's
  ``.grad`` is a view into it, so autograd accumulates straight into the
  bucket and the allreduce works on the tensor's memory through its NumPy view
  (zero copies).
* A ``register_post_accumulate_grad_hook`` counts the gradients of each bucket;
  when a bucket is complete (and all buckets before it have been started, so
  every rank issues the same collectives in the same order) its
  ``comm.allreduce(..., op="avg", async_op=True)`` starts while backward goes
  on computing the gradients of earlier layers.
* Before the optimizer step the script waits for every bucket.

Checks (the script raises, which aborts the job, if one fails):

(a) every ``--hash-every`` steps the ranks allgather a hash of their
    parameters; all must be bitwise identical;
(b) ``--check-single``: rank 0 also trains the same model in one process and
    compares the final weights.  Its gradient is what data parallelism
    computes: the mean of the N shards' gradients, each shard's forward and
    backward on its own (the same matrix shapes as on the ranks), summed in
    rank order.  With ``-n 1`` the weights must be bitwise identical; with
    ``-n N`` we accept ``|w - w_ref| <= atol + rtol * |w_ref|`` with
    ``atol=1e-5, rtol=1e-4`` (the allreduce may round its mean otherwise).
    It also reports the difference to plain training on the full global batch
    (a different float32 summation, and on a GPU other kernels for the larger
    matrices: 1e-7 after 50 steps on CPUs, 2e-4 after 30 steps at n = 4 on an
    H200), which it does not check.

Measurements (rank 0 prints them): the median step time, and the fraction of
communication hidden behind backward: ``1 - exposed / blocking`` where
``exposed`` is the median time spent waiting for the buckets after backward
returned, and ``blocking`` is the median time the same bucket allreduces take
when run one after another with nothing else going on (measured after training,
on scratch copies of the buckets).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

try:
    import pycoll
except ImportError:  # running from a checkout without installing
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import pycoll

ATOL = 1e-5
RTOL = 1e-4


# ----------------------------------------------------------------------------- model, data
def build_model(seed: int, features: int, hidden: int, layers: int, classes: int) -> nn.Module:
    """An MLP with identical initial weights on every rank (seeded)."""
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    width = features
    for _ in range(layers):
        mods += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    mods.append(nn.Linear(width, classes))
    return nn.Sequential(*mods)


def make_data(seed: int, samples: int, features: int, classes: int) -> tuple[Any, Any]:
    """A synthetic classification set: labels from a random linear teacher."""
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal((samples, features), dtype=np.float32)
    w = rng.standard_normal((features, classes), dtype=np.float32)
    y = np.argmax(x @ w + 0.5 * rng.standard_normal((samples, classes)), axis=1)
    return torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))


def global_batch(step: int, batch: int, samples: int, seed: int) -> np.ndarray:
    """Indices of the global batch of ``step``: a fresh permutation per epoch."""
    per_epoch = samples // batch
    epoch, i = divmod(step, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(samples)
    return perm[i * batch : (i + 1) * batch]


def shard(indices: np.ndarray, rank: int, size: int) -> np.ndarray:
    """Rank ``rank``'s contiguous share of a global batch (equal shares)."""
    k = len(indices) // size
    return indices[rank * k : (rank + 1) * k]


def _sync(t: torch.Tensor) -> None:
    """Wait for the GPU (a CUDA run times what the device did, not what was queued)."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def param_hash(model: nn.Module) -> int:
    h = hashlib.blake2b(digest_size=8)
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return int.from_bytes(h.digest(), "little")


# ----------------------------------------------------------------------------- buckets
@dataclass
class Bucket:
    index: int
    params: list[nn.Parameter]
    flat: torch.Tensor  # float32, contiguous; every param's .grad is a view into it
    view: Any  # what pycoll reduces: flat.numpy() on the host (same memory), else flat
    pending: int = 0
    request: Any = None
    started: float = 0.0


@dataclass
class GradSync:
    """Bucketed gradient averaging over a pycoll communicator, overlapped with backward."""

    comm: Any
    model: nn.Module
    bucket_bytes: int
    overlap: bool = True
    algorithm: str = "auto"
    buckets: list[Bucket] = field(default_factory=list)
    next_launch: int = 0
    ready: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in reversed(params):  # backward produces the last layers' grads first
            if groups[-1] and size + p.numel() * 4 > self.bucket_bytes:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += p.numel() * 4
        owner: dict[int, int] = {}
        for i, group in enumerate(groups):
            dev = group[0].device
            flat = torch.zeros(sum(p.numel() for p in group), dtype=torch.float32, device=dev)
            off = 0
            for p in group:
                p.grad = flat[off : off + p.numel()].view_as(p)
                owner[id(p)] = i
                off += p.numel()
            self.buckets.append(Bucket(i, group, flat, flat if flat.is_cuda else flat.numpy()))
        if self.overlap:
            for p in params:
                p.register_post_accumulate_grad_hook(self._hook(owner[id(p)]))
        self.ready = [False] * len(self.buckets)

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.flat.zero_()
            b.pending = len(b.params)
            b.request = None
        self.ready = [False] * len(self.buckets)
        self.next_launch = 0

    def _hook(self, index: int) -> Any:
        def hook(_: torch.Tensor) -> None:
            b = self.buckets[index]
            b.pending -= 1
            if b.pending == 0:
                self.ready[index] = True
                # Start buckets strictly in index order, so that all ranks issue
                # the same sequence of collectives whatever order autograd takes.
                while self.next_launch < len(self.buckets) and self.ready[self.next_launch]:
                    self._launch(self.buckets[self.next_launch])
                    self.next_launch += 1

        return hook

    def _launch(self, b: Bucket) -> None:
        b.started = time.perf_counter()
        b.request = self.comm.allreduce(b.view, op="avg", algorithm=self.algorithm, async_op=True)

    def finish(self) -> None:
        """Wait for every bucket (start any that backward did not complete)."""
        if not self.overlap:
            for b in self.buckets:
                self.comm.allreduce(b.view, op="avg", algorithm=self.algorithm)
            return
        while self.next_launch < len(self.buckets):  # unused parameters: nothing to wait for
            self._launch(self.buckets[self.next_launch])
            self.next_launch += 1
        for b in self.buckets:
            b.request.wait()

    def blocking_time(self, reps: int) -> float:
        """Median time of the bucket allreduces run back to back on scratch copies."""
        scratch = [b.flat.clone() for b in self.buckets]
        views = [s if s.is_cuda else s.numpy() for s in scratch]
        times = []
        for _ in range(reps):
            _sync(scratch[0])
            self.comm.barrier()
            t0 = time.perf_counter()
            for v in views:
                self.comm.allreduce(v, op="avg", algorithm=self.algorithm)
            _sync(scratch[0])
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


# ----------------------------------------------------------------------------- training
def train_single(args: argparse.Namespace, x: Any, y: Any, shards: int = 0) -> nn.Module:
    """A reference in one process: plain autograd on the full global batch, or
    (``shards`` > 0) the mean of the gradients of that many shards, each its own
    forward and backward, summed in rank order as the allreduce does."""
    model = build_model(args.seed, args.features, args.hidden, args.layers, args.classes)
    model.to(x.device)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(args.steps):
        idx = global_batch(step, args.batch, args.samples, args.seed)
        opt.zero_grad()
        if not shards:
            loss_fn(model(x[torch.from_numpy(idx)]), y[torch.from_numpy(idx)]).backward()
            opt.step()
            continue
        total: list[torch.Tensor] = []
        for r in range(shards):
            mine = torch.from_numpy(shard(idx, r, shards))
            model.zero_grad()
            loss_fn(model(x[mine]), y[mine]).backward()
            grads = [p.grad for p in params]
            total = grads if not total else [a + g for a, g in zip(total, grads, strict=True)]  # type: ignore[operator]
        for p, g in zip(params, total, strict=True):
            p.grad = g / shards
        opt.step()
    return model


def _max_diff(a: nn.Module, b: nn.Module) -> tuple[float, float, bool]:
    """max |w - w_ref|, max (|w - w_ref| - RTOL |w_ref|), and bitwise equality."""
    diff, worst = 0.0, 0.0
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        d = (p.detach() - q.detach()).abs()
        diff = max(diff, float(d.max()))
        worst = max(worst, float((d - RTOL * q.detach().abs()).max()))
    same = all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    return diff, worst, same


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=256, help="global batch (split across ranks)")
    p.add_argument("--bucket-mb", type=float, default=1.0, help="bucket size in MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--samples", type=int, default=8192)
    p.add_argument("--hash-every", type=int, default=10, help="replica check every K steps")
    p.add_argument("--check-single", action="store_true", help="compare with 1-process training")
    p.add_argument("--no-overlap", action="store_true", help="allreduce after backward, blocking")
    p.add_argument("--algorithm", default="auto", help="pycoll allreduce algorithm")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    p.add_argument("--comm-reps", type=int, default=5, help="repetitions of the blocking timing")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: model, data and gradient buckets on rank %% GPUs (pycoll's device path)",
    )
    p.add_argument("--json", help="rank 0 writes its results here")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        from mpi4py import MPI

        # before init: the communicator's device buffers live on the current device
        torch.cuda.set_device(MPI.COMM_WORLD.Get_rank() % torch.cuda.device_count())
    comm = pycoll.init()
    rank, size = comm.rank, comm.size
    if args.batch % size:
        raise SystemExit(f"--batch {args.batch} is not divisible by the {size} ranks")
    if args.samples < args.batch:
        raise SystemExit(f"--samples {args.samples} is smaller than --batch {args.batch}")

    dev = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else None
    x, y = make_data(args.seed, args.samples, args.features, args.classes)
    model = build_model(args.seed, args.features, args.hidden, args.layers, args.classes)
    if dev is not None:
        x, y = x.to(dev), y.to(dev)
        model.to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loss_fn = nn.CrossEntropyLoss()
    sync = GradSync(
        comm, model, int(args.bucket_mb * (1 << 20)), not args.no_overlap, args.algorithm
    )
    nparams = sum(p.numel() for p in model.parameters())

    from tqdm import tqdm

    bar = tqdm(
        range(args.steps),
        disable=rank != 0 or args.no_progress,
        desc=f"train n={size}",
        file=sys.stderr,
    )
    step_times: list[float] = []
    waits: list[float] = []
    hash_checks = 0
    loss_val = float("nan")
    for step in bar:
        t0 = time.perf_counter()
        idx = torch.from_numpy(
            shard(global_batch(step, args.batch, args.samples, args.seed), rank, size)
        )
        sync.zero_grad()
        loss = loss_fn(model(x[idx]), y[idx])
        loss.backward()
        t1 = time.perf_counter()
        sync.finish()
        t2 = time.perf_counter()
        opt.step()
        _sync(x)
        t3 = time.perf_counter()
        if step >= args.warmup:
            step_times.append(t3 - t0)
            waits.append(t2 - t1)
        loss_val = float(loss.detach())
        if rank == 0 and (step + 1) % 10 == 0:
            bar.set_postfix(loss=f"{loss_val:.4f}", refresh=False)
        if (step + 1) % args.hash_every == 0 or step + 1 == args.steps:
            mine = np.array([param_hash(model)], np.uint64)
            every = comm.allgather(mine).reshape(-1)
            if (every != every[0]).any():
                raise RuntimeError(
                    f"rank {rank}: replicas diverged at step {step + 1}: parameter hashes "
                    + ", ".join(f"rank {r}: {int(h):016x}" for r, h in enumerate(every))
                )
            hash_checks += 1
    bar.close()

    blocking = sync.blocking_time(args.comm_reps) if size > 1 else 0.0
    exposed = statistics.median(waits) if waits else 0.0
    step_med = statistics.median(step_times) if step_times else 0.0
    result: dict[str, Any] = {
        "n": size,
        "steps": args.steps,
        "batch": args.batch,
        "bucket_mb": args.bucket_mb,
        "buckets": len(sync.buckets),
        "params": nparams,
        "overlap": not args.no_overlap,
        "final_loss": loss_val,
        "step_s": step_med,
        "exposed_wait_s": exposed,
        "blocking_comm_s": blocking,
        "hidden_fraction": (max(0.0, 1.0 - exposed / blocking) if blocking > 0 else None),
        "hash_checks": hash_checks,
        "replicas_identical": True,
        "device": args.device,
        "transport": comm.transport_of((rank + 1) % size, device=dev is not None),
    }

    if args.check_single and rank == 0:
        diff, worst, identical = _max_diff(model, train_single(args, x, y, shards=size))
        full_diff, _, full_identical = _max_diff(model, train_single(args, x, y))
        result.update(
            single_max_abs_diff=diff,
            single_identical=identical,
            single_atol=ATOL,
            single_rtol=RTOL,
            single_ok=worst <= ATOL and (identical or size > 1),
            full_batch_max_abs_diff=full_diff,
            full_batch_identical=full_identical,
        )
        if not result["single_ok"]:
            raise RuntimeError(
                f"rank 0: {size}-rank training differs from single-process training: "
                f"max |w - w_ref| = {diff:.3g} (atol {ATOL}, rtol {RTOL}, identical={identical})"
            )

    if rank == 0:
        hidden = result["hidden_fraction"]
        print(
            f"n={size} params={nparams} buckets={len(sync.buckets)} (bucket {args.bucket_mb} MiB) "
            f"steps={args.steps} batch={args.batch} transport={result['transport']}\n"
            f"step time {1e3 * step_med:.2f} ms (median over {len(step_times)} steps), "
            f"final loss {loss_val:.4f}\n"
            f"communication: blocking {1e3 * blocking:.2f} ms, exposed wait after backward "
            f"{1e3 * exposed:.2f} ms, hidden "
            + ("n/a" if hidden is None else f"{100 * hidden:.0f}%")
            + f"\nreplicas bitwise identical at {hash_checks} checks"
        )
        if args.check_single:
            print(
                f"single-process reference (mean of {size} shard gradients): max |w - w_ref| = "
                f"{result['single_max_abs_diff']:.3g}, bitwise identical: "
                f"{result['single_identical']} (tolerance atol={ATOL}, rtol={RTOL}): OK\n"
                f"single-process training on the full batch (not checked): max |w - w| = "
                f"{result['full_batch_max_abs_diff']:.3g}, bitwise identical: "
                f"{result['full_batch_identical']}"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    # Close only once every rank has finished its last collective (see the
    # README: a shm peer closing early can fail a receive already delivered).
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()
    comm.close()
    return result


if __name__ == "__main__":
    main()
