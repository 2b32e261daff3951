"""What every test shares: nothing of a job is left in /dev/shm."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.launch import mpich_segments, remove_orphans


@pytest.fixture(autouse=True)
def _no_mpich_leftovers() -> Iterator[None]:
    """Remove MPICH's segments that a test's jobs left behind.  MPICH leaves its
    segment when a rank is killed (the fault tests kill ranks on purpose); CI
    fails on anything new in /dev/shm, and pycoll's own segments are not
    touched here, so a segment pycoll leaks still fails it."""
    before = mpich_segments()
    yield
    new = mpich_segments() - before
    if new:
        remove_orphans(new)
