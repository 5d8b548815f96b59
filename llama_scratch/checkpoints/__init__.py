"""Bytes on disk to tensors and back: atomic writes, the Hugging Face layout, streaming load and save,
GGUF, resume points, the export writers and the run record (classifier.json). Imports the model only."""
