"""pycoll's errors as torch sees them.

A collective's pycoll error reaches torch code as an instance of its pycoll
class and of ``torch.distributed.DistBackendError`` at once (see
:func:`torch_error`); what pycoll does not offer raises
:class:`~pycoll.UnsupportedError` naming the operation and what to use instead.
"""

from __future__ import annotations

import torch.distributed as dist

from pycoll.errors import PycollError, UnsupportedError

_TORCH_ERRORS: dict[type[BaseException], type[BaseException]] = {}


def torch_error(exc: BaseException) -> BaseException:
    """``exc`` as an instance of its pycoll class and of torch's ``DistBackendError``.

    torch code catches ``RuntimeError`` (or ``DistBackendError``) from a failed
    collective, as Gloo raises; pycoll code catches ``PeerAbortedError`` and the
    like.  The copy keeps the message, the attributes (rank, peer, recorder...),
    the cause and the traceback.  User errors (``InvalidArgumentError``, a
    ``ValueError``) and foreign exceptions pass unchanged.
    """
    if not isinstance(exc, PycollError) or isinstance(exc, (ValueError, RuntimeError)):
        return exc
    base = type(exc)
    cls = _TORCH_ERRORS.get(base)
    if cls is None:
        cls = type(base.__name__, (base, dist.DistBackendError), {"__module__": base.__module__})
        cls.__qualname__ = base.__qualname__
        _TORCH_ERRORS[base] = cls
    new = cls.__new__(cls, *exc.args)
    new.args = exc.args
    new.__dict__.update(exc.__dict__)
    new.__cause__ = exc.__cause__
    new.__suppress_context__ = exc.__suppress_context__
    return new.with_traceback(exc.__traceback__)


def unsupported(rank: int, what: str, instead: str) -> BaseException:
    return torch_error(
        UnsupportedError(
            f"pycoll backend, rank {rank}: {what} is not supported by pycoll yet; {instead}",
            rank=rank,
        )
    )


GLOO = "run it on a Gloo group: dist.new_group(backend='gloo')"
