"""pytest-ppsmoke: prove a pipeline-parallel LLM deployment works across machines.

The runtime (transport, codec, membership, names, actors) imports and runs without pytest;
``pytest_ppsmoke.plugin`` holds the pytest hooks.
"""

__version__ = "0.1.0"
