"""llama_scratch: a from-scratch Llama-3 in plain PyTorch, and the tools to fine-tune it as a text classifier."""

from .classifier import LlamaClassifier
from .config import LlamaConfig
from .model import Llama
from .sources import load_model
from .tokenizer import Tokenizer
from .weights import load_weights, save_checkpoint, save_weights

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
