"""Packaging: the licence, the metadata, and README's commands agreeing with CI."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(120)


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_licence_file_is_the_apache_2_text() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert len(re.findall(r"(?m)^   \d\. ", text)) == 9  # sections 1-9


def test_project_licence_is_an_spdx_string_with_its_file() -> None:
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    # PEP 639: with a licence expression, no licence classifier
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]
    assert "Typing :: Typed" in project["classifiers"]
    assert project["name"] == "pycoll-collectives"


def test_torch_extra_brings_tqdm_for_the_examples() -> None:
    torch = _pyproject()["project"]["optional-dependencies"]["torch"]
    assert any(d.startswith("torch") for d in torch) and any(d.startswith("tqdm") for d in torch)


def test_built_metadata_has_the_licence_expression(tmp_path: Path) -> None:
    """setuptools accepts the table (PEP 639) and writes License-Expression."""
    code = (
        "import setuptools.build_meta as b, sys; "
        "print(b.prepare_metadata_for_build_wheel(sys.argv[1]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    if proc.returncode and "setuptools" in proc.stderr and "No module named" in proc.stderr:
        pytest.skip("setuptools is not installed")
    assert proc.returncode == 0, proc.stderr[-3000:]
    dist = tmp_path / proc.stdout.strip().splitlines()[-1]
    meta = (dist / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in meta
    assert "License-File: LICENSE" in meta
    assert (dist / "licenses" / "LICENSE").exists()
    assert "Name: pycoll-collectives" in meta


def test_readme_first_lines_are_the_two_commands_and_ci_installs_the_same_torch() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    cmds = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert len(cmds) == 2
    main_job, tests = cmds
    assert "benchmarks/sweep.py allreduce" in main_job
    assert tests.endswith(".venv/bin/python -m pytest")
    pin = re.search(r"pip install (torch==[\d.]+) --extra-index-url \S+/whl/cpu", tests)
    assert pin, tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"pip install -q {pin.group(1)}" in ci
    assert "pip install -q -e '.[mpich,test,lint]'" in ci and "'.[mpich,test]'" in tests
    assert (
        "pycoll-collectives" in readme and "unrelated projects, `pycoll` and `transports`" in readme
    )
