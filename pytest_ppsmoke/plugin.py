"""pytest hooks for pytest-ppsmoke (``pytest11`` entry point ``ppsmoke``).

The markers are registered here so that ``--strict-markers`` accepts them in any project that
installs the plugin. The fixtures that rent GPUs and form the cluster come with the lifecycle.
"""

from __future__ import annotations

import pytest

MARKERS = {
    "local": (
        "runs on this machine with no key, no GPU and no network: loopback iroh, CPU tinygrad, the vast.ai emulator"
    ),
    "vastai": "rents real GPUs on vast.ai; needs --vastai-key or VAST_API_KEY",
    "gpu": "needs a CUDA GPU on this machine",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, help_text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {help_text}")
