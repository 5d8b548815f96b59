"""llama_scratch: a from-scratch Llama-3 in plain PyTorch, and the tools to fine-tune it as a text classifier."""

from .classifier import LlamaClassifier
from .config import LlamaConfig
from .model import Llama
from .tokenizer import Tokenizer

__all__ = ["LlamaConfig", "Llama", "LlamaClassifier", "Tokenizer"]
