"""Labelled texts: the file formats and their column finder (for training and for classify's inputs),
Hub datasets, train/val/test splits, and token batches (packed or padded)."""
