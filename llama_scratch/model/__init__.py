"""The network and what it is made of: the config, the layers top to bottom (llama.py), packed batches,
LoRA, the classification head, the tokenizer and its BPE vocabularies, parameter counts. Knows tensors and token
ids only: no file format, no loop, no command."""
