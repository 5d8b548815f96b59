"""A trial of mean pooling on the task suite, before the classifier has an option for it (issue #39).

    python benchmarks/pooling_trial.py --rows 500 --candidates 2@1e-3 --tasks kjv_chapters --json /tmp/mean.json

Runs `benchmarks/recipes.py` with its arguments, with `LlamaClassifier.forward` replaced for this process only: the
head reads the mean of each text's vectors after the final norm (its real tokens only, packed or padded) instead of
the last real token's. Everything else (splits, training, the baseline, the table) is recipes.py's own, so its
figures sit beside recipes.py's last-token figures for the same task and seed.

Why try it: on the suite's two lexical tasks (which words a text uses decides its class) the bag-of-words baseline
beats the last-token classifier. With the last 2 blocks training, a text's last token gathers the text through two
attention layers only; the mean reads every token's vector directly, as the baseline reads every word.

This file patches the model in a benchmark, which the package never does: it is a measurement, and goes once the
classifier pools either way by a setting of its own (transformers' `LlamaForSequenceClassification` pools the last
token only, so an export must then refuse or carry the mean). Figures: benchmarks/RESULTS.md, "Mean pooling".
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch

from llama_scratch.model import classifier
from llama_scratch.model.layout import Layout


def mean_pooled(self, input_ids, attention_mask=None, frozen_states=None, *, layout=None) -> torch.Tensor:
    """`LlamaClassifier.forward`, pooling the mean of each text's normed vectors. The last block runs at every
    position (the last-token forward runs it at the last tokens only)."""
    backbone = self.backbone
    x = backbone.embed_tokens(input_ids) if frozen_states is None else frozen_states
    layout = Layout.plain(attention_mask, x.shape[1], x.device) if layout is None else layout
    start = 0 if frozen_states is None else self.frozen_blocks
    h = backbone.final_norm(backbone.run_blocks(x, layout, start=start))  # [B, T, dim], packed [1, N, dim]
    if layout.texts is not None:  # packed: one stretch of the stream per text
        pooled = torch.stack([t.mean(0) for t in layout.texts.split(h)])
    else:  # padded (pads weigh nothing) or unpadded
        real = layout.real if layout.real is not None else torch.ones(h.shape[:2], dtype=torch.bool, device=h.device)
        real = real[:, -h.shape[1] :].to(h.dtype)[..., None]
        pooled = (h * real).sum(1) / real.sum(1)
    return self.head(pooled)


if __name__ == "__main__":
    classifier.LlamaClassifier.forward = mean_pooled
    here = Path(__file__).resolve().parent
    sys.argv = [str(here / "recipes.py"), *sys.argv[1:]]
    runpy.run_path(str(here / "recipes.py"), run_name="__main__")
