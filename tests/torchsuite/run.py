"""Run torch's distributed test suite on one backend at one world size, and record
every test's outcome (pass, fail or skip, with the reason) in a JSON file.

::

    python -m tests.torchsuite.run --backend pycoll --world-size 2 --out pycoll-2.json
    python -m tests.torchsuite.run --backend gloo --world-size 3 --out gloo-3.json -k all_reduce

The file is rewritten after every test (so a long run can be watched), and
``--resume`` skips the tests it already holds (``--retry-failed`` runs only
those it holds as failed).  Tests run one at a time, each
in ``--world-size`` fresh processes, each bounded by ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import unittest
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: The line that starts an exception in a child's traceback (its type and message).
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Timeout|Exit|Interrupt)\b")


def reason_of(text: str) -> str:
    """A failure's reason: the exception line of the first failed process's
    traceback (and the two lines after it), or how the process ended."""
    timed = re.search(r"Process \d+ terminated or timed out after [\d.]+ seconds", text)
    if timed:
        return timed.group(0)
    lines = text.strip().splitlines()
    starts = [i for i, line in enumerate(lines) if _RAISED.match(line)]
    first = text.find("Process ")
    if first >= 0:  # the first failed process's own traceback
        end = text.find("\nProcess ", first + 1)
        block = text[first : end if end > 0 else len(text)].strip().splitlines()
        own = [i for i, line in enumerate(block) if _RAISED.match(line)]
        if own:
            lines, starts = block, own
    if not starts:
        return " ".join(lines[-3:])[:400]
    at = starts[-1]
    said = [lines[at].strip()]
    for line in lines[at + 1 : at + 3]:  # a message that goes on over lines
        if not line.strip() or line.startswith("To execute this test"):
            break
        said.append(line.strip())
    return " ".join(said)[:400]


class Recorder(unittest.TestResult):
    """Keeps each test's outcome: ``{name: {"status", "reason", "seconds"}}``."""

    def __init__(self, on_done: Any) -> None:
        super().__init__()
        self.outcomes: dict[str, dict[str, Any]] = {}
        self._start = 0.0
        self._on_done = on_done

    def startTest(self, test: unittest.TestCase) -> None:
        super().startTest(test)
        self._start = time.monotonic()

    def _keep(self, test: unittest.TestCase, status: str, reason: str = "") -> None:
        name = test.id().split(".")[-1]
        seconds = round(time.monotonic() - self._start, 1)
        self.outcomes[name] = {"status": status, "reason": reason, "seconds": seconds}
        self._on_done(name, self.outcomes[name])

    def addSuccess(self, test: unittest.TestCase) -> None:
        self._keep(test, "pass")

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        self._keep(test, "skip", reason)

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        self._keep(test, "fail", reason_of(self._exc_info_to_string(err, test)))

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        self._keep(test, "fail", reason_of(self._exc_info_to_string(err, test)))

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:
        self._keep(test, "pass", "expected failure")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        self._keep(test, "fail", "unexpected success")


#: The reasons the suite's own checks give where CUDA devices are missing.
_NO_CUDA = re.compile(r"^(CUDA is not available\.|Need at least \d+ CUDA devices)$")


def _cuda_skip(outcome: dict[str, Any] | None) -> bool:
    return bool(outcome) and outcome["status"] == "skip" and bool(_NO_CUDA.match(outcome["reason"]))


def test_names(cls: type, pattern: str | None, only: list[str] | None) -> list[str]:
    names = unittest.TestLoader().getTestCaseNames(cls)
    if only:
        missing = sorted(set(only) - set(names))
        if missing:
            raise SystemExit(f"no such tests: {', '.join(missing)}")
        return [n for n in names if n in only]
    if pattern:
        names = [n for n in names if re.search(pattern, n)]
    return list(names)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", required=True, help="pycoll, gloo, ...")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--out", required=True, help="the JSON file of outcomes")
    p.add_argument("-k", dest="pattern", help="only tests whose name matches this regex")
    p.add_argument("--tests", help="only these tests (comma-separated names)")
    p.add_argument("--timeout", type=int, default=120, help="seconds per test (default 120)")
    p.add_argument("--resume", action="store_true", help="skip the tests --out already holds")
    p.add_argument(
        "--retry-failed", action="store_true", help="run again only the tests --out holds as failed"
    )
    p.add_argument("--list", action="store_true", help="print the selected tests and exit")
    p.add_argument(
        "--cuda-skips-from",
        metavar="FILE",
        help="take the skips for missing CUDA devices of a run on this machine as this "
        "run's, without spawning them",
    )
    p.add_argument(
        "--gate-as",
        metavar="BACKEND",
        help="select (run or skip) the tests as for this backend, e.g. gloo (see suite.py)",
    )
    args = p.parse_args(argv)

    # What the suite reads when it is imported, here and in every spawned process.
    os.environ["BACKEND"] = args.backend
    os.environ["WORLD_SIZE"] = str(args.world_size)
    os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(args.timeout)
    if args.gate_as:
        os.environ["TORCHSUITE_GATE"] = args.gate_as
    os.environ.setdefault("TEMP_DIR", "/tmp")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    import torch

    from tests.torchsuite.suite import TestDistBackendWithSpawn

    only = args.tests.split(",") if args.tests else None
    names = test_names(TestDistBackendWithSpawn, args.pattern, only)
    if args.list:
        print("\n".join(names))
        return 0
    out = Path(args.out)
    record: dict[str, Any] = {
        "backend": args.backend,
        "world_size": args.world_size,
        "gate_as": args.gate_as or args.backend,
        "torch": torch.__version__,
        "date": date.today().isoformat(),
        "command": " ".join([sys.executable, "-m", "tests.torchsuite.run", *sys.argv[1:]]),
        "tests": {},
    }
    if (args.resume or args.retry_failed) and out.exists():
        record["tests"] = json.loads(out.read_text())["tests"]
        if args.retry_failed:
            names = [n for n in names if record["tests"].get(n, {}).get("status") == "fail"]
        else:
            names = [n for n in names if n not in record["tests"]]

    def save(name: str, outcome: dict[str, Any]) -> None:
        record["tests"][name] = outcome
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
        tmp.replace(out)
        print(f"[torchsuite] {name}: {outcome['status']} {outcome['reason']}"[:300], flush=True)

    if args.cuda_skips_from:  # no CUDA device here: they skip whatever the backend or size
        seen = json.loads(Path(args.cuda_skips_from).read_text())["tests"]
        for name in [n for n in names if _cuda_skip(seen.get(n))]:
            why = f"{seen[name]['reason']} (not run: as in {Path(args.cuda_skips_from).name})"
            save(name, {"status": "skip", "reason": why, "seconds": 0.0})
            names.remove(name)
    result = Recorder(save)
    unittest.TestSuite(TestDistBackendWithSpawn(n) for n in names).run(result)
    counts = {s: 0 for s in ("pass", "fail", "skip")}
    for o in record["tests"].values():
        counts[o["status"]] += 1
    print(f"[torchsuite] {args.backend} at {args.world_size}: {counts}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
