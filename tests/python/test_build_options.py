"""The build's CUDA switch (PAGEDCORE_CUDA=AUTO|ON|OFF) and the package's
independence from torch, checked by configuring the real CMake project."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pagedcore

ROOT = Path(__file__).resolve().parents[2]


def configure(tmp_path: Path, mode: str, with_nvcc: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("CUDACXX", None)
    if not with_nvcc:
        # A PATH with cmake but no nvcc: the machine "has no CUDA".
        cmake_dir = Path(shutil.which("cmake")).parent
        env["PATH"] = os.pathsep.join([str(cmake_dir), "/usr/bin", "/bin"])
        if shutil.which("nvcc", path=env["PATH"]):
            pytest.skip("nvcc is in /usr/bin or /bin: cannot hide it")
    return subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(tmp_path / "build"), f"-DPAGEDCORE_CUDA={mode}"],
        env=env, capture_output=True, text=True, timeout=300,
    )


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
class TestCudaSwitch:
    def test_on_without_nvcc_fails_loudly(self, tmp_path: Path) -> None:
        r = configure(tmp_path, "ON", with_nvcc=False)
        assert r.returncode != 0
        assert "PAGEDCORE_CUDA=ON but no CUDA compiler (nvcc) was found" in r.stderr

    def test_auto_without_nvcc_builds_without_kernels(self, tmp_path: Path) -> None:
        r = configure(tmp_path, "AUTO", with_nvcc=False)
        assert r.returncode == 0, r.stderr
        assert "pagedcore: no nvcc found, building without CUDA kernels" in r.stdout

    def test_off_never_looks_for_cuda(self, tmp_path: Path) -> None:
        r = configure(tmp_path, "OFF", with_nvcc=False)
        assert r.returncode == 0, r.stderr
        assert "CUDA" not in r.stdout

    def test_unknown_mode_is_refused(self, tmp_path: Path) -> None:
        r = configure(tmp_path, "maybe", with_nvcc=False)
        assert r.returncode != 0
        assert "PAGEDCORE_CUDA must be AUTO, ON or OFF, got 'MAYBE'" in r.stderr


def test_the_package_needs_no_torch() -> None:
    code = "import sys, pagedcore; pagedcore.Engine(num_blocks=4); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    if shutil.which("ldd"):
        libs = subprocess.run(["ldd", pagedcore._C.__file__], capture_output=True, text=True).stdout
        assert "torch" not in libs and "libc10" not in libs
        # The CUDA runtime is linked statically.
        assert "libcudart" not in libs
