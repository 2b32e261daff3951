"""Point-to-point, the exchanges, object collectives and subgroups through
torch.distributed on the pycoll backend (run under mpiexec or torchrun, n >= 2).

Every rank computes what every other rank sends from a seed, so each result is
checked against values computed here with torch.  Each rank prints a
JSON line ``{"rank": r, "checks": [...]}`` naming the checks that passed; a
failed check raises (the job fails).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pycoll.torch_backend

DONE: list[str] = []


def passed(name: str) -> None:
    DONE.append(name)


def data(src: int, dst: int, rows: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What rank ``src`` sends rank ``dst``: ``rows`` rows of 3, from a seed."""
    g = torch.Generator().manual_seed(1000 * src + dst)
    return (torch.randn(rows, 3, generator=g) * 100).to(dtype)


def point_to_point(r: int, n: int) -> None:
    right, left = (r + 1) % n, (r - 1) % n
    # blocking send/recv around the ring, rank 0 first
    got = torch.empty(4, 3)
    if r == 0:
        dist.send(data(r, right, 4), right)
        dist.recv(got, left)
    else:
        dist.recv(got, left)
        dist.send(data(r, right, 4), right)
    assert torch.equal(got, data(left, r, 4)), got
    passed("send/recv")
    # irecv before isend on every rank, with a tag, an integer dtype
    got = torch.empty(2, 3, dtype=torch.int64)
    w1 = dist.irecv(got, left, tag=7)
    w2 = dist.isend(data(r, right, 2, torch.int64), right, tag=7)
    w2.wait()
    w1.wait()
    assert torch.equal(got, data(left, r, 2, torch.int64)), got
    assert w1.is_completed() and w1.is_success()
    passed("isend/irecv")
    # any source (a tag of its own: the next section's messages match any source
    # too): rank 0 takes one message from every other rank
    if r == 0:
        seen = set()
        for _ in range(n - 1):
            t = torch.empty(1, 3)
            src = dist.recv(t, tag=5)
            assert torch.equal(t, data(src, 0, 1)), (src, t)
            seen.add(src)
        assert seen == set(range(1, n)), seen
        t = torch.empty(1, 3)
        work = dist.irecv(t, tag=5)
        work.wait()
        assert work._source_rank() == 1 and torch.equal(t, data(1, 0, 1)), t
    else:
        dist.send(data(r, 0, 1), 0, tag=5)
        if r == 1:
            dist.send(data(r, 0, 1), 0, tag=5)
    passed("recv_anysource")
    # batch_isend_irecv: a ring both ways, bfloat16
    a, b = torch.empty(3, 3, dtype=torch.bfloat16), torch.empty(3, 3, dtype=torch.bfloat16)
    ops = [
        dist.P2POp(dist.isend, data(r, right, 3, torch.bfloat16), right),
        dist.P2POp(dist.isend, data(r, left, 3, torch.bfloat16), left, tag=1),
        dist.P2POp(dist.irecv, a, left),
        dist.P2POp(dist.irecv, b, right, tag=1),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(a, data(left, r, 3, torch.bfloat16)), a
    assert torch.equal(b, data(right, r, 3, torch.bfloat16)), b
    passed("batch_isend_irecv ring")
    # the same ring posted together: _coalescing_manager with a device
    c = torch.empty(2, 3)
    with _coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
        dist.isend(data(r, right, 2), right)
        dist.irecv(c, left)
    cm.wait()
    assert torch.equal(c, data(left, r, 2)), c
    passed("coalesced send/recv")
    # a non-contiguous receive, and a send to itself
    nc = torch.zeros(3, 4).t()  # 4 x 3, not contiguous
    w = dist.irecv(nc, left)
    dist.send(data(r, right, 4), right)
    w.wait()
    assert torch.equal(nc, data(left, r, 4)), nc
    me = torch.empty(1, 3)
    w = dist.irecv(me, r)
    dist.isend(data(r, r, 1), r).wait()
    w.wait()
    assert torch.equal(me, data(r, r, 1))
    passed("non-contiguous, self")


def all_to_all(r: int, n: int) -> None:
    # even: 2 rows to every rank
    x = torch.cat([data(r, j, 2) for j in range(n)])
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x)
    assert torch.equal(out, torch.cat([data(i, r, 2) for i in range(n)])), out
    passed("all_to_all_single even")
    # uneven: rank i sends (i + j) % 3 rows to rank j (zero splits included)
    rows = lambda i, j: (i + j) % 3
    x = torch.cat([data(r, j, rows(r, j), torch.float64) for j in range(n)])
    out = torch.empty(sum(rows(i, r) for i in range(n)), 3, dtype=torch.float64)
    dist.all_to_all_single(
        out,
        x,
        output_split_sizes=[rows(i, r) for i in range(n)],
        input_split_sizes=[rows(r, j) for j in range(n)],
    )
    want = torch.cat([data(i, r, rows(i, r), torch.float64) for i in range(n)])
    assert torch.equal(out, want), (out, want)
    passed("all_to_all_single uneven")
    # every split zero but the one to the next rank
    right = (r + 1) % n
    x = data(r, right, 2, torch.int32)
    out = torch.empty(2, 3, dtype=torch.int32)
    dist.all_to_all_single(
        out,
        x,
        output_split_sizes=[2 if j == (r - 1) % n else 0 for j in range(n)],
        input_split_sizes=[2 if j == right else 0 for j in range(n)],
    )
    assert torch.equal(out, data((r - 1) % n, r, 2, torch.int32)), out
    passed("all_to_all_single zero splits")
    # lists of tensors of different sizes per pair
    ins = [data(r, j, 1 + (r + j) % 2) for j in range(n)]
    outs = [torch.empty(1 + (i + r) % 2, 3) for i in range(n)]
    dist.all_to_all(outs, ins)
    for i in range(n):
        assert torch.equal(outs[i], data(i, r, 1 + (i + r) % 2)), (i, outs[i])
    passed("all_to_all")


def rooted(r: int, n: int) -> None:
    root = n - 1
    x = data(r, root, 2, torch.float16)
    outs = [torch.empty(2, 3, dtype=torch.float16) for _ in range(n)] if r == root else None
    dist.gather(x, outs, dst=root)
    if r == root:
        for i in range(n):
            assert torch.equal(outs[i], data(i, root, 2, torch.float16)), (i, outs[i])
    passed("gather")
    out = torch.empty(2, 3, dtype=torch.uint8)
    ins = [data(0, j, 2, torch.uint8) for j in range(n)] if r == 0 else None
    dist.scatter(out, ins, src=0)
    assert torch.equal(out, data(0, r, 2, torch.uint8)), out
    passed("scatter")
    objs = [None] * n if r == 0 else None
    dist.gather_object({"rank": r, "pad": "x" * (10 * r)}, objs, dst=0)
    if r == 0:
        assert objs == [{"rank": i, "pad": "x" * (10 * i)} for i in range(n)], objs
    passed("gather_object")
    got = [None]
    items = [("item", i, list(range(i))) for i in range(n)] if r == 0 else None
    dist.scatter_object_list(got, items, src=0)
    assert got[0] == ("item", r, list(range(r))), got
    passed("scatter_object_list")


def coalesced(r: int, n: int) -> None:
    """Coalesced all_reduce: one allreduce per dtype, whatever the tensors' count."""
    pg = dist.distributed_c10d._get_default_group()
    before = len([c for c in pg.communicator.recent() if " allreduce(" in c])
    a, b = torch.full((3,), float(r)), torch.full((2, 2), 2.0 * r)
    c = torch.arange(4, dtype=torch.int64) * r
    d = torch.full((5,), float(r + 1)).t()  # a float32 of another shape
    with _coalescing_manager():
        for t in (a, c, b, d):
            dist.all_reduce(t)
    s = n * (n - 1) / 2
    assert torch.equal(a, torch.full((3,), s)) and torch.equal(b, torch.full((2, 2), 2 * s))
    assert torch.equal(c, torch.arange(4, dtype=torch.int64) * int(s))
    assert torch.equal(d, torch.full((5,), s + n)), d
    calls = [c for c in pg.communicator.recent() if " allreduce(" in c][before:]
    assert len(calls) == 2, calls  # float32 (a, b, d packed), int64 (c)
    passed("all_reduce coalesced, one per dtype")
    work = dist.barrier(async_op=True)
    work.wait()
    assert work.is_completed()
    passed("barrier async")


def subgroups(r: int, n: int) -> None:
    """Subgroups split from the world, their collectives interleaved with the
    world's from this one thread; a Gloo subgroup stays Gloo."""
    world = dist.distributed_c10d._get_default_group()
    low = dist.new_group([0, 1])
    high = dist.new_group(list(range(1, n)))
    gloo = dist.new_group(backend="gloo")
    assert dist.get_backend(gloo) == "gloo"
    assert dist.get_backend(low if r < 2 else high) == "pycoll"
    for g in (low, high):
        if g is not dist.GroupMember.NON_GROUP_MEMBER:
            assert g.communicator._engine.fam is world.communicator._engine.fam
    for step in range(3):
        works = []
        t = torch.full((2,), float(r + step))
        works.append(dist.all_reduce(t, async_op=True))
        if r in (0, 1):
            u = torch.full((2,), float(10 * r))
            works.append(dist.all_reduce(u, group=low, async_op=True))
        if r >= 1:
            v = torch.full((3,), float(r))
            dist.broadcast(v, src=n - 1, group=high)
            assert torch.equal(v, torch.full((3,), float(n - 1))), v
        if n > 2 and r in (1, 2):  # point-to-point on the world between them
            other = 3 - r
            got = torch.empty(1)
            w = dist.irecv(got, other)
            dist.send(torch.full((1,), float(r)), other)
            w.wait()
            assert got.item() == other, got
        g = torch.ones(1)
        dist.all_reduce(g, group=gloo)
        for w in works:
            w.wait()
        assert torch.equal(t, torch.full((2,), n * step + n * (n - 1) / 2)), t
        if r in (0, 1):
            assert torch.equal(u, torch.full((2,), 10.0)), u
        assert g.item() == n
    if r in (0, 1):
        outs = [torch.empty(2) for _ in range(2)]
        dist.all_gather(outs, torch.full((2,), float(r)), group=low)
        assert [o.tolist() for o in outs] == [[0, 0], [1, 1]], outs
        objs = [None] * 2
        dist.all_gather_object(objs, f"r{r}", group=low)
        assert objs == ["r0", "r1"], objs
    dist.destroy_process_group(low)
    dist.destroy_process_group(high)
    x = torch.ones(1)
    dist.all_reduce(x)
    assert x.item() == n
    passed("subgroups interleaved with the world")


def main() -> None:
    torch.set_num_threads(1)
    pycoll.torch_backend.register(timeout=float(os.environ.get("EXCHANGES_TIMEOUT", "60")))
    dist.init_process_group("pycoll")
    r, n = dist.get_rank(), dist.get_world_size()
    point_to_point(r, n)
    all_to_all(r, n)
    rooted(r, n)
    coalesced(r, n)
    subgroups(r, n)
    dist.barrier()
    print(json.dumps({"rank": r, "size": n, "checks": DONE}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
