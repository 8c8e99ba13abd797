"""pytest-ppsmoke: prove a pipeline-parallel LLM deployment works across machines.

The package is a stack of layers, each importing only its own and those below it, from the
faces (the pytest plugin, ``pp-smoke-run``) down to what both sides of the wire share:
``docs/code.md`` lists them, with each module's role. Importing this package imports only the
standard library.
"""

import functools


@functools.cache
def _version() -> str:
    from importlib import metadata  # some 35 ms: read when asked, not by every node and worker

    try:
        return metadata.version("pytest-ppsmoke")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0.0.0"


def __getattr__(name: str) -> str:
    """``__version__``, and ``DEFAULT_IMAGE`` (the node image docker/Dockerfile builds, tagged
    with it): read from the installed package's metadata on first use."""
    if name == "__version__":
        return _version()
    if name == "DEFAULT_IMAGE":
        return f"ghcr.io/pytest-ppsmoke/gpu-node:{_version()}"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
