"""llama_scratch: a from-scratch Llama-3 in plain PyTorch, and the tools to fine-tune it as a text classifier.

The package is in folders that are its layers (ARCHITECTURE.md): `model/` (the network, LoRA, the head, the
tokenizer), `checkpoints/` (files), `sources/` (what `--model` means), `data/`, `parallel/`, `training/` and
`planning/`; the commands are the modules at the top (`llama-scratch --help` lists them).

The public names are imported on first use, not when the package is: `llama-scratch --help` and every
`python -m llama_scratch.COMMAND` import this package first, and an eager import here would make each of them pay
for torch and the whole package before it does anything (and `python -m llama_scratch.download` warned, when
the package imported that module before it ran as __main__). `from llama_scratch import load_model` works as ever.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for type checkers and editors only; at run time __getattr__ imports them
    from .checkpoints.weights import load_weights, save_checkpoint, save_weights
    from .model.classifier import LlamaClassifier
    from .model.config import LlamaConfig
    from .model.llama import Llama
    from .model.tokenizer import Tokenizer
    from .sources.resolve import load_model

# public name -> the module that defines it (tests/commands/test_first_day.py checks it against __all__)
_HOMES = {
    "LlamaConfig": "model.config",
    "Llama": "model.llama",
    "LlamaClassifier": "model.classifier",
    "Tokenizer": "model.tokenizer",
    "load_weights": "checkpoints.weights",
    "load_model": "sources.resolve",
    "save_checkpoint": "checkpoints.weights",
    "save_weights": "checkpoints.weights",
}

__all__ = [
    "LlamaConfig",
    "Llama",
    "LlamaClassifier",
    "Tokenizer",
    "load_weights",
    "load_model",
    "save_checkpoint",
    "save_weights",
]


def __getattr__(name: str) -> object:
    """A public name, imported from its module when first asked for (PEP 562), then kept as a package attribute."""
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
