"""Which algorithm a call runs: forced (the argument, ``PYCOLL_ALGO``) or ``auto``
(the cost model, :mod:`pycoll.algorithms.cost`, refined online by a tuner,
:mod:`pycoll.tune`), and for device buffers whether they go through the host.

Every choice depends only on what every rank passes and on facts all ranks
agreed at ``init``, so all ranks pick the same algorithm for the same call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pycoll import algorithms
from pycoll.algorithms import cost
from pycoll.algorithms.direct import GROUP_ALGORITHMS
from pycoll.config import SLICED_COPY_BYTES, Config
from pycoll.errors import InvalidArgumentError
from pycoll.plans import make_room
from pycoll.reduce import ReduceOp
from pycoll.tune import Tuner, tunable

#: ``auto`` keeps a tuner (or its absence) for the first this many kinds of call
#: (collective, size, dtype, op, root); later kinds take the model's choice and
#: are not kept, so the cache never grows past it.
TUNERS_MAX = 256


class Policy:
    """A communicator's algorithm choice.

    Args:
        rank, size, config: the communicator's.
        group: whether every rank shares the group segment (the ``direct``
            algorithms need it); ``group_why``: why there is or is not one.
        agree: ``agree(v, names)`` sums a float64 vector over the ranks with the
            model's pick of allreduce ``names`` (a tuner's round ends with it).
        gpu: the device side (``one_sided``, ``shared_device``), or None.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        config: Config,
        group: bool,
        group_why: str,
        agree: Callable[[np.ndarray, tuple[str, ...]], np.ndarray],
        gpu: Any,
    ) -> None:
        self.rank = rank
        self.size = size
        self.config = config
        self._group = group
        self.group_why = group_why
        self._agree = agree
        self.gpu = gpu
        self._candidates: dict[str, tuple[str, ...]] = {}
        # auto's online choices, by (collective, bytes, dtype, op, root); None: not tuned
        self.tuners: dict[tuple[Any, ...], Tuner | None] = {}
        # ... and the name and function each runs its calls by, made once
        self.tuned: dict[Tuner, tuple[str, Callable[..., None]]] = {}
        self._early: dict[tuple[str, int], bool] = {}  # returns_early's answers

    def candidates(self, what: str) -> tuple[str, ...]:
        """The algorithms of ``what`` that can run here, in registration order."""
        avail = self._candidates.get(what)
        if avail is None:
            avail = self._candidates[what] = tuple(
                a for a in algorithms.names(what) if self.usable(a)
            )
        return avail

    def usable(self, algorithm: str) -> bool:
        """Whether host ``algorithm`` can run here (``direct`` and ``cma`` need the
        shared group)."""
        return algorithm not in GROUP_ALGORITHMS or self.size == 1 or self._group

    def algorithm(self, what: str, algorithm: str, nbytes: int) -> str:
        """The algorithm a call asked for, or the model's pick for ``auto``.

        Raises:
            InvalidArgumentError: not a string, not an algorithm of ``what``, or
                one that cannot run here (the message says why).
        """
        avail = self.candidates(what)
        if not isinstance(algorithm, str):
            raise InvalidArgumentError(
                f"rank {self.rank}: {what}: algorithm={algorithm!r} must be a string"
            )
        name = algorithm.lower()
        if name == "auto":
            name = self.config.algorithm_for(what) or "auto"
        if name == "auto":
            return cost.choose(
                what,
                avail,
                self.size,
                nbytes,
                self.config.chunk_bytes,
                self.config.group_slot_bytes,
            )
        if name not in avail:
            if name in algorithms.names(what):
                raise InvalidArgumentError(
                    f"rank {self.rank}: {what}: algorithm={algorithm!r} is not available "
                    f"here: {name} needs every rank on one host sharing memory "
                    f"({self.group_why})"
                )
            raise InvalidArgumentError(
                f"rank {self.rank}: {what}: algorithm={algorithm!r} is not one of "
                f"{', '.join(('auto', *algorithms.names(what)))}"
            )
        return name

    def _auto(self, what: str, requested: str) -> bool:
        """Whether ``auto`` chooses (nothing forced by the call or PYCOLL_ALGO)."""
        return requested.lower() == "auto" and not self.config.algorithm_for(what)

    def tuner(
        self,
        what: str,
        requested: str,
        nbytes: int,
        dtype: np.dtype[Any],
        op: ReduceOp | None,
        root: int,
    ) -> Tuner | None:
        """The online choice for host calls of this kind (:mod:`pycoll.tune`), or
        None where ``auto`` was not asked for, tuning is off, results could
        depend on the algorithm, or the model sees no close contender.  Made at
        the first call of its kind, which every rank makes at the same point, and
        kept (plans hold it), so every rank's schedule counts the same calls."""
        if (
            self.size < 2
            or not self.config.tune
            or not tunable(what, self.size, dtype)
            or not self._auto(what, requested)
        ):
            return None
        key = (what, nbytes, dtype, op, root)
        try:
            return self.tuners[key]
        except KeyError:
            pass
        if len(self.tuners) >= TUNERS_MAX:
            # Later kinds are left to the model and not recorded; no tuner is ever
            # evicted (plans of one rank may hold one another rank would make afresh).
            return None
        t = None
        cfg = self.config
        names = cost.contenders(
            what, self.candidates(what), self.size, nbytes, cfg.chunk_bytes, cfg.group_slot_bytes
        )
        if len(names) > 1:
            label = f"{what} {nbytes} B {dtype}" + (f" {op.name.lower()}" if op else "")
            t = Tuner(label, names, self._sum)
        self.tuners[key] = t
        return t

    def _sum(self, v: np.ndarray) -> np.ndarray:
        return self._agree(v, self.candidates("allreduce"))

    def host(self, what: str, algo: str, tuner: Tuner | None) -> tuple[str, Callable[..., None]]:
        """The name a call records and the function that runs it on host arrays:
        ``algo``'s, or one that runs what ``tuner`` names."""
        if tuner is None:
            return algo, algorithms.get(what, algo)
        try:
            return self.tuned[tuner]
        except KeyError:
            fns = [algorithms.get(what, a) for a in tuner.names]
            made = self.tuned[tuner] = (f"auto[{','.join(tuner.names)}]", tuner.over(fns))
            return made

    def via_host(self, what: str, requested: str, nbytes: int) -> bool:
        """Whether a device collective goes through host memory and the host
        algorithms: small messages when ``auto`` picks (up to
        :meth:`Config.device_host_limit`), except on a GPU that all ranks share,
        with the default limits, where a rank's copy back to the device would
        be under :data:`~pycoll.config.SLICED_COPY_BYTES`.  A broadcast between
        two ranks stays on the host: its one copy back is queued and nothing
        waits for it (``benchmarks/RESULTS.md``, device section)."""
        if self.size == 1 or nbytes > self.config.device_host_limit(what):
            return False
        if not self._auto(what, requested):
            return False
        g = self.gpu
        if g is None or not g.shared_device or (what == "broadcast" and self.size == 2):
            return True
        if self.config.device_host_bytes is not None:
            return True
        if what == "allgather":
            back = nbytes * self.size
        elif what == "reduce_scatter":
            back = nbytes // self.size
        else:
            back = nbytes
        return back >= SLICED_COPY_BYTES

    def async_via_host(self, what: str, nbytes: int) -> bool:
        """Whether the torch backend's asynchronous ``what`` on CUDA tensors of
        ``nbytes`` goes through pinned host mirrors: every rank shares one GPU
        and ``nbytes`` is at most :attr:`Config.device_async_host_bytes` (only
        allreduce, DDP's call).  Every input is agreed by all ranks (the GPU
        layout at init, the settings, the call's size), so all take one route."""
        g = self.gpu
        return (
            what == "allreduce"
            and g is not None
            and g.shared_device
            and self.size > 1
            and 0 < self.config.device_async_host_bytes >= nbytes
        )

    def device(self, coll: Any, requested: str, algo: str) -> str:
        """The algorithm for device buffers: ``direct`` (one-sided windows between
        every pair) when all pairs have them, the collective has them, and no
        other one was asked for; else the host's choice, but ``direct`` (the
        group segment is host memory) becomes the first other algorithm."""
        what = coll.name
        if algo == "cma":  # a route of direct's host algorithms: on the device, direct
            algo = "direct"
        if (
            coll.windows
            and self.gpu.one_sided
            and (algo == "direct" or self._auto(what, requested))
        ):
            return "direct"
        if algo != "direct":
            return algo
        return next(a for a in algorithms.names(what) if a not in GROUP_ALGORITHMS)

    def returns_early(self, coll: Any, nbytes: int) -> bool:
        """Whether a blocking ``auto`` call of ``coll`` on device buffers of ``nbytes``
        returns before its device work is done: the ``direct`` path, whose host
        part is the peers' descriptors (docs/gpu.md, "Streams and the host")."""
        what = coll.name
        known = self._early.get((what, nbytes))
        if known is None:
            known = (
                self.gpu is not None
                and not self.via_host(what, "auto", nbytes)
                and self.device(coll, "auto", self.algorithm(what, "auto", nbytes)) == "direct"
            )
            make_room(self._early, 4096)
            self._early[what, nbytes] = known
        return known
