"""CUDA build and device reporting through the bindings."""

from __future__ import annotations

import pagedcore
import pytest


def test_cuda_info_keys_and_types() -> None:
    info = pagedcore.cuda_info()
    assert set(info) == {"compiled", "device_count", "runtime_version", "driver_version"}
    assert isinstance(info["compiled"], bool)
    for key in ("device_count", "runtime_version", "driver_version"):
        assert isinstance(info[key], int) and not isinstance(info[key], bool), key
        assert info[key] >= 0, (key, info[key])
    if info["compiled"]:
        # A CUDA build links a runtime, e.g. 12040 or 13000.
        assert info["runtime_version"] >= 1000
    else:
        assert info == {
            "compiled": False,
            "device_count": 0,
            "runtime_version": 0,
            "driver_version": 0,
        }
    if info["device_count"] > 0:
        # A device is only visible through a driver.
        assert info["driver_version"] > 0


def test_cuda_info_is_stable() -> None:
    assert pagedcore.cuda_info() == pagedcore.cuda_info()


@pytest.mark.cuda
def test_cuda_smoke_kernel_runs_on_device() -> None:
    info = pagedcore.cuda_info()
    assert info["compiled"] is True
    assert info["device_count"] >= 1
    assert pagedcore.cuda_smoke_test() is None


def test_cuda_smoke_without_device_raises() -> None:
    info = pagedcore.cuda_info()
    if info["device_count"] > 0:
        # With a device the smoke test must pass; the marked test covers the
        # kernel, this one checks that the call returns cleanly.
        assert info["compiled"] is True
        assert pagedcore.cuda_smoke_test() is None
        return
    with pytest.raises(RuntimeError) as excinfo:
        pagedcore.cuda_smoke_test()
    message = str(excinfo.value)
    if info["compiled"]:
        assert "no CUDA device" in message
    else:
        assert "without CUDA" in message
