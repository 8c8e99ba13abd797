"""pytest-ppsmoke: prove a pipeline-parallel LLM deployment works across machines.

The package is a stack of layers, each importing only its own and those below it, from the
faces (the pytest plugin, ``pp-smoke-run``) down to what both sides of the wire share:
``docs/code.md`` lists them, with each module's role. Importing this package imports only the
standard library.
"""

from importlib import metadata

try:
    __version__ = metadata.version("pytest-ppsmoke")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.0.0"

DEFAULT_IMAGE = f"ghcr.io/pytest-ppsmoke/gpu-node:{__version__}"  # docker/Dockerfile builds it
