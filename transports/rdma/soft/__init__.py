"""A software RDMA provider: the part of pyverbs' API that pycoll uses, in Python.

The RDMA transport is written once against pyverbs (rdma-core's Python
binding).  This package offers the same classes and calls so the transport runs
on machines without an HCA: ``Context``, ``PD``, ``MR``, ``DmaBufMR``, ``CQ``
(``poll``), ``QP`` (``to_init/to_rtr/to_rts``, ``modify``, ``post_send``,
``post_recv``), ``QPInitAttr``, ``QPCap``, ``QPAttr``, ``AHAttr``,
``GlobalRoute``, ``GID``, ``SendWR``, ``RecvWR``, ``SGE``, ``WC``, the
``IBV_*`` constants (:mod:`.enums`) and ``PyverbsRDMAError``.

What is emulated, with RC semantics, between processes over TCP (loopback or
198.18.0.0/15 addresses only):

* the QP state machine (post_send outside RTS fails with EINVAL; posts to a QP
  in ERR complete with IBV_WC_WR_FLUSH_ERR);
* RDMA WRITE, WRITE WITH IMMEDIATE (consumes a posted receive), SEND/RECV
  (scatter into the receive's SGEs), RDMA READ; ordering within a QP;
* target-side checks of rkey, PD, MR and QP access flags and bounds before any
  byte is written: IBV_WC_REM_ACCESS_ERR / IBV_WC_REM_INV_REQ_ERR at the
  requester, nothing written, and the responder QP in ERR; local key errors
  give IBV_WC_LOC_PROT_ERR, a too-small receive IBV_WC_LOC_LEN_ERR;
* receiver-not-ready: RNR NAK, wait of the responder's ``min_rnr_timer``,
  go-back-N resend, ``rnr_retry`` attempts (7 = forever), then
  IBV_WC_RNR_RETRY_EXC_ERR;
* QP to ERR flushes every outstanding WR with IBV_WC_WR_FLUSH_ERR; a peer that
  disappears (its QP destroyed, its process gone) puts the QP in ERR, the
  first outstanding send completing with IBV_WC_RETRY_EXC_ERR;
* memory regions over Python buffers or raw virtual addresses; ``DmaBufMR``
  with iova = offset over an fd that can be mapped (memfd, udmabuf), or over a
  CUDA range given by its device pointer (``soft_cuda_ptr``), the "DMA" being
  CUDA copies (cuda.bindings, else CuPy; imported only then);
* claimed capabilities (``Context(soft_caps={"peermem", "dmabuf"})``), so
  pycoll's gdr and dmabuf registration paths can run on a GPU machine.

What it cannot emulate, and does not pretend to:

* real DMA: every byte is copied by the kernel's TCP stack and by Python; a
  claimed ``peermem``/``dmabuf`` capability exercises the API, not the hardware
  path, and says nothing about a NIC's ability to reach the GPU;
* UD/UC/XRC QPs, SRQs, atomics, memory windows, inline-receive, completion
  channels and events, CQ overrun (the CQ grows), signal-free WR batching
  limits beyond ``max_send_wr``, path migration, SQD, multiple ports or GIDs;
* the transport timer: a peer that is alive but silent is never timed out here
  (callers keep their own deadlines); a peer that vanishes is noticed at once
  (a real HCA notices only when it next sends and its retries run out);
* a responder QP in ERR stays silent, as on the wire: its peer learns of the
  error from the NAK it got, or when the QP is destroyed;
* InfiniBand routing: the port's LID is the context's TCP port and the GID its
  IPv4-mapped address; they route the emulation and nothing else;
* the lkey/rkey distinction (both are the same number) and key randomness.

Progress: each context has a helper thread that sleeps in ``select`` (no busy
spin) and serves the sockets when no user thread does.  ``CQ.poll`` on an
empty queue and ``QP.post_send`` run the NIC's ready work in the calling thread
(as a provider's poll does), so a polling thread gets its completions without a
thread hand-off; ``CQ.poll`` never blocks for long.  ``CQ.wait(seconds)`` is a
soft-only extension (what a completion channel gives a real provider): it
blocks until NIC events arrive or the time is up.  See
:mod:`transports.rdma.soft.engine`.
"""

from __future__ import annotations

from transports.rdma.soft import enums
from transports.rdma.soft.addr import GID, AHAttr, GlobalRoute
from transports.rdma.soft.cq import CQ, WC
from transports.rdma.soft.device import SOFT_CAPS, Context, Device, get_device_list
from transports.rdma.soft.mr import MR, DmaBufMR
from transports.rdma.soft.pd import PD
from transports.rdma.soft.pyverbs_error import (
    PyverbsError,
    PyverbsRDMAError,
    PyverbsUserError,
)
from transports.rdma.soft.qp import QP, QPAttr, QPCap, QPInitAttr
from transports.rdma.soft.wr import SGE, RecvWR, SendWR

__all__ = [
    "CQ",
    "GID",
    "MR",
    "PD",
    "QP",
    "SGE",
    "SOFT_CAPS",
    "WC",
    "AHAttr",
    "Context",
    "Device",
    "DmaBufMR",
    "GlobalRoute",
    "PyverbsError",
    "PyverbsRDMAError",
    "PyverbsUserError",
    "QPAttr",
    "QPCap",
    "QPInitAttr",
    "RecvWR",
    "SendWR",
    "enums",
    "get_device_list",
]
