"""scripts/bootstrap.sh skips pip when nothing it installs from changed, and still
reinstalls after a C++ change, a requirements change or a lost extension.

Runs the script in a copy of its inputs whose .venv/bin/python is a stub that
records each call (nothing is installed).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUB = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../calls.log"
if [[ "$*" == *"-e ."* ]]; then
  mkdir -p "$(dirname "$0")/../lib/python3.11/site-packages/pagedcore"
  touch "$(dirname "$0")/../lib/python3.11/site-packages/pagedcore/_C.so"
fi
"""
INSTALL_DEPS = "-m pip install -q --disable-pip-version-check -r requirements-dev.txt"
INSTALL_SELF = "-m pip install -q --disable-pip-version-check --no-build-isolation -e ."

needs_system = pytest.mark.skipif(
    shutil.which("cmake") is None
    or subprocess.run(["dpkg", "-s", "libgtest-dev"], capture_output=True).returncode != 0,
    reason="bootstrap.sh would apt-get install cmake / libgtest-dev first",
)


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    for name in ("pyproject.toml", "requirements-dev.txt", "CMakeLists.txt"):
        shutil.copy(ROOT / name, tmp_path)
    for name in ("cmake", "cpp", "cuda"):
        shutil.copytree(ROOT / name, tmp_path / name)
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "bootstrap.sh", tmp_path / "scripts")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(STUB)
    python.chmod(0o755)
    return tmp_path


def _pip_calls(checkout: Path) -> list[str]:
    subprocess.run(["scripts/bootstrap.sh"], cwd=checkout, check=True, capture_output=True)
    log = checkout / ".venv" / "calls.log"
    calls = [c for c in log.read_text().splitlines() if "pip install" in c] if log.exists() else []
    log.unlink(missing_ok=True)
    return calls


@needs_system
def test_second_bootstrap_skips_pip_and_a_change_reinstalls(checkout: Path) -> None:
    first = _pip_calls(checkout)
    assert INSTALL_DEPS in first and INSTALL_SELF in first
    assert _pip_calls(checkout) == []

    with open(checkout / "cpp" / "src" / "engine.cpp", "a") as f:
        f.write("// changed\n")
    assert _pip_calls(checkout) == [INSTALL_SELF]  # the build only, not the dependencies
    assert _pip_calls(checkout) == []

    with open(checkout / "requirements-dev.txt", "a") as f:
        f.write("# changed\n")
    assert _pip_calls(checkout) == [INSTALL_DEPS, INSTALL_SELF]

    shutil.rmtree(checkout / ".venv" / "lib" / "python3.11" / "site-packages" / "pagedcore")
    assert _pip_calls(checkout) == [INSTALL_SELF]
