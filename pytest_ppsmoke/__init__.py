"""pytest-ppsmoke: prove a pipeline-parallel LLM deployment works across machines.

The layers, each importing only those below it: ``plugin`` and ``spec`` (the pytest face),
``harness`` (the one run driver, settings, report, CLI, pytest session), ``cloud`` (vast.ai
client, emulator, deployment), ``stage`` (tinygrad stage model, worker bridge, ``pp-gpu-node``),
``messages`` (the pipeline's messages, registered with the runtime's codec), ``runtime``
(transport, codec, SWIM, names, actors, child processes), and ``protocol``,
``nodeenv`` and ``failpoints``, which both sides of the wire share. Importing this package
imports only the standard library.
"""

from importlib import metadata

try:
    __version__ = metadata.version("pytest-ppsmoke")
except metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.0.0"

DEFAULT_IMAGE = f"ghcr.io/pytest-ppsmoke/gpu-node:{__version__}"  # docker/Dockerfile builds it
