"""Config spellings (init's arguments read as their variables are) and logging."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

import pycoll
from pycoll.config import GROUP_SLOT_ALIGN, LOG_FORMAT, Config, parse_bytes
from pycoll.errors import InvalidArgumentError

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    "text,want",
    [
        ("65536", 65536),
        ("64K", 64 << 10),
        ("64k", 64 << 10),
        ("64KB", 64 << 10),
        ("64KiB", 64 << 10),
        ("1M", 1 << 20),
        ("1.5M", 3 << 19),
        (" 1G ", 1 << 30),
        ("0", 0),
    ],
)
def test_parse_bytes(text: str, want: int) -> None:
    assert parse_bytes(text) == want


@pytest.mark.parametrize("text", ["lots", "1.5", "0.3K", "inf", "nan", "", "1X"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_bytes(text)


@pytest.mark.parametrize(
    "field,var,text",
    [
        ("chunk_bytes", "PYCOLL_CHUNK_BYTES", "1M"),
        ("chunk_bytes", "PYCOLL_CHUNK_BYTES", "65536"),
        ("device_chunk_bytes", "PYCOLL_DEVICE_CHUNK_BYTES", "4M"),
        ("device_host_bytes", "PYCOLL_DEVICE_HOST_BYTES", "0"),
        ("device_async_host_bytes", "PYCOLL_DEVICE_ASYNC_HOST_BYTES", "2M"),
        ("group_slot_bytes", "PYCOLL_GROUP_SLOT_BYTES", "64K"),
        ("timeout", "PYCOLL_TIMEOUT", "12.5"),
        ("check", "PYCOLL_CHECK", "on"),
        ("tune", "PYCOLL_TUNE", "no"),
        ("transports", "PYCOLL_TRANSPORT", "TCP,shm"),
        ("transports", "PYCOLL_TRANSPORT", "auto"),
        ("algo", "PYCOLL_ALGO", "allreduce:tree,ring"),
        ("device_transports", "PYCOLL_DEVICE_TRANSPORT", "staged"),
        ("device_transports", "PYCOLL_DEVICE_TRANSPORT", "cuda_ipc"),
        ("debug", "PYCOLL_DEBUG", "warning"),
    ],
)
def test_an_argument_takes_the_spellings_of_its_variable(field: str, var: str, text: str) -> None:
    """init(chunk_bytes="1M") means what PYCOLL_CHUNK_BYTES=1M does."""
    by_env = Config.from_env({var: text})
    by_arg = Config.from_env({}, **{field: text})
    assert getattr(by_arg, field) == getattr(by_env, field)
    assert not isinstance(getattr(by_arg, field), str) or field == "debug"


def test_init_takes_chunk_bytes_as_a_string() -> None:
    assert Config.from_env({}, chunk_bytes="1M").chunk_bytes == 1 << 20
    assert Config(chunk_bytes="64K").chunk_bytes == 64 << 10  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"config chunk_bytes='lots': not a size"):
        Config.from_env({}, chunk_bytes="lots")
    with pytest.raises(InvalidArgumentError, match="at least 64"):
        Config.from_env({}, chunk_bytes="8")


def test_device_transport_error_lists_every_valid_value() -> None:
    for value in ("nvlink", ","):
        with pytest.raises(InvalidArgumentError) as info:
            Config.from_env({"PYCOLL_DEVICE_TRANSPORT": value})
        msg = str(info.value)
        assert msg.startswith("PYCOLL_DEVICE_TRANSPORT=")
        for word in ("auto", "none", "host", "staged", "cuda_ipc"):
            assert word in msg, (value, msg)
    with pytest.raises(InvalidArgumentError, match="auto, none, host, staged"):
        Config(device_transports=("nvlink",))


def test_transport_error_lists_auto_too() -> None:
    with pytest.raises(InvalidArgumentError, match="auto, or a comma list of shm, rdma, tcp"):
        Config.from_env({"PYCOLL_TRANSPORT": "ib"})


@pytest.mark.parametrize("value", ["7", "4095", "5000", "64K1", "1.5K"])
def test_group_slot_bytes_the_segment_cannot_use_are_rejected(value: str) -> None:
    with pytest.raises(InvalidArgumentError, match="PYCOLL_GROUP_SLOT_BYTES"):
        Config.from_env({"PYCOLL_GROUP_SLOT_BYTES": value})


@pytest.mark.parametrize("value,want", [("0", 0), ("4K", 4096), ("8192", 8192), ("256K", 1 << 18)])
def test_group_slot_bytes_accepts_whole_pages(value: str, want: int) -> None:
    assert Config.from_env({"PYCOLL_GROUP_SLOT_BYTES": value}).group_slot_bytes == want


def test_group_slot_alignment_is_the_segments_page() -> None:
    from transports import shm_group

    assert GROUP_SLOT_ALIGN == shm_group._PAGE
    # the segment rounds a slot up to whole pages: what Config accepts, it keeps
    assert shm_group.segment_bytes(2, GROUP_SLOT_ALIGN) - shm_group.segment_bytes(2, 0) == (
        2 * shm_group.SLOTS * GROUP_SLOT_ALIGN
    )


def test_config_does_not_import_the_algorithms_at_module_level() -> None:
    """config sits below the algorithms: it imports them only to check a name."""
    import ast

    tree = ast.parse((ROOT / "pycoll" / "config.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    mods = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
    mods |= {f"{n.module}.{a.name}" for n in top if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not [m for m in mods if "algorithms" in m], mods


# ------------------------------------------------------------------ logging
def _handlers_after_init(debug: str | None) -> str:
    """Run ``pycoll.init()`` at n = 1 in a fresh process; print the handlers."""
    code = (
        "import logging, pycoll\n"
        "with pycoll.init() as comm:\n"
        "    pass\n"
        "for name in ('', 'pycoll', 'transports'):\n"
        "    lg = logging.getLogger(name)\n"
        "    print(repr(name), lg.level, lg.propagate,"
        " sorted(type(h).__name__ for h in lg.handlers))\n"
    )
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYCOLL_")}
    env["PYTHONPATH"] = str(ROOT)
    if debug is not None:
        env["PYCOLL_DEBUG"] = debug
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=90
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_without_pycoll_debug_init_attaches_no_stream_handler() -> None:
    out = _handlers_after_init(None)
    assert "StreamHandler" not in out, out
    assert "'pycoll' 0 True ['NullHandler']" in out, out
    assert "'transports' 0 True ['NullHandler']" in out, out
    assert "'' 30 True []" in out, out  # the root logger is untouched


def test_pycoll_debug_attaches_one_stderr_handler() -> None:
    out = _handlers_after_init("INFO")
    assert "'pycoll' 20 False ['NullHandler', 'StreamHandler']" in out, out
    assert "'transports' 20 False ['NullHandler', 'StreamHandler']" in out, out
    assert "'' 30 True []" in out, out


def test_log_format_has_host_pid_and_rank() -> None:
    import os
    import socket

    fmt = logging.Formatter(LOG_FORMAT.format(host=socket.gethostname(), rank=3))
    rec = logging.LogRecord("pycoll.x", logging.INFO, __file__, 1, "hello", None, None)
    line = fmt.format(rec)
    assert f" {socket.gethostname()}:{os.getpid()} pycoll[3] INFO pycoll.x: hello" in line, line


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_failed_collective_is_raised_not_also_logged_at_error() -> None:
    """The error reaches the caller once, as the exception (logged at INFO only)."""
    import numpy as np

    from tests.inproc import communicators

    seen = _Records()
    lg = logging.getLogger("pycoll")
    old = lg.level
    lg.addHandler(seen)
    lg.setLevel(logging.INFO)
    try:
        with communicators(2, timeout=0.5) as comms:
            with pytest.raises(pycoll.CollectiveTimeout):
                comms[0].allreduce(np.ones(3, np.float32))  # alone: rank 1 never joins
    finally:
        lg.removeHandler(seen)
        lg.setLevel(old)
    assert not [r for r in seen.records if r.levelno >= logging.ERROR], [
        r.getMessage() for r in seen.records if r.levelno >= logging.ERROR
    ]
    assert any("rank 0 raises" in r.getMessage() for r in seen.records)
