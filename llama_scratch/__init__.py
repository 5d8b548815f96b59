"""llama_scratch: a from-scratch Llama-3 in plain PyTorch, and the tools to fine-tune it as a text classifier.

The public names are imported on first use, not when the package is: `python -m llama_scratch.download` imports
this package before it runs `download` as __main__, and an eager import here (sources imports download) would
load that module a second time and make Python warn (RuntimeWarning: found in sys.modules). Lazily, importing the
package runs no command module, and `from llama_scratch import load_model` still works.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for type checkers and editors only; at run time __getattr__ imports them
    from .classifier import LlamaClassifier
    from .config import LlamaConfig
    from .model import Llama
    from .sources import load_model
    from .tokenizer import Tokenizer
    from .weights import load_weights, save_checkpoint, save_weights

# public name -> the module that defines it (tests/test_first_day.py checks it against __all__)
_HOMES = {
    "LlamaConfig": "config",
    "Llama": "model",
    "LlamaClassifier": "classifier",
    "Tokenizer": "tokenizer",
    "load_weights": "weights",
    "load_model": "sources",
    "save_checkpoint": "weights",
    "save_weights": "weights",
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
