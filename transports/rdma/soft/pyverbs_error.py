"""The exceptions of pyverbs (``pyverbs.pyverbs_error``), same names and fields."""

from __future__ import annotations

import os


class PyverbsError(Exception):
    """Base exception of the provider."""

    def __init__(self, msg: str, error_code: int = -1) -> None:
        super().__init__(msg)
        self.error_code = error_code


class PyverbsRDMAError(PyverbsError):
    """A verbs call failed; ``error_code`` is the errno, as in pyverbs."""

    def __init__(self, msg: str, error_code: int = -1) -> None:
        if error_code > 0:
            msg = f"{msg}. Errno: {error_code}, {os.strerror(error_code)}"
        super().__init__(msg, error_code)


class PyverbsUserError(PyverbsError):
    """The caller passed something invalid."""
