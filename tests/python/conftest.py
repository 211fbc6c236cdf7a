"""Shared pytest configuration for the pagedcore Python tests.

The ``cuda`` marker is declared in pyproject.toml (pytest runs with
--strict-markers); this file only skips the tests that carry it on machines
where the CUDA driver reports no device.
"""

from __future__ import annotations

import pagedcore
import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items:
        return
    info = pagedcore.cuda_info()
    if info["device_count"] > 0:
        return
    if info["compiled"]:
        why = (
            "needs an NVIDIA GPU: pagedcore was built with CUDA "
            f"(runtime {info['runtime_version']}) but the driver reports no CUDA device "
            f"(device_count == 0, driver_version {info['driver_version']})"
        )
    else:
        why = (
            "needs an NVIDIA GPU: pagedcore was built without CUDA "
            "(PAGEDCORE_CUDA=OFF or no nvcc) and reports device_count == 0"
        )
    skip = pytest.mark.skip(reason=why)
    for item in cuda_items:
        item.add_marker(skip)
