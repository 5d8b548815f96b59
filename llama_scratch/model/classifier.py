"""A Llama backbone with a classification head: the vector of each text's last real token (or the mean of all its
tokens' vectors, `pooling="mean"`) predicts its class."""

from __future__ import annotations

import torch
from torch import nn

from .layout import Layout, last_real_positions
from .llama import Llama
from .lora import LoRASettings, add_lora, lora_layers


def trained_blocks(n_layers: int, train_last: int | None) -> range:
    """Indices of the blocks that `train_last` trains: the last `train_last` of `n_layers` (None: all). The one
    place this is decided; the classifier, the frozen-prefix cache and the memory plan all ask here."""
    if train_last is not None and not 0 <= train_last <= n_layers:
        raise ValueError(f"train_last must be between 0 and {n_layers} (the number of blocks), got {train_last}")
    return range(0 if train_last is None else n_layers - train_last, n_layers)


def full_precision_blocks(n_layers: int, train_last: int | None, lora: LoRASettings | None) -> int:
    """How many top blocks keep full-precision weights when the base is quantized: those that train whole. With
    LoRA none do (QLoRA: the adapters train over the quantized weights). Training and `classify` both ask here."""
    return 0 if lora is not None else len(trained_blocks(n_layers, train_last))


def last_real_token(hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """[B, T, dim] -> [B, dim]: the vector at each row's last real position."""
    last = last_real_positions(attention_mask, hidden.shape[0], hidden.shape[1], hidden.device)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


# How the head reads a text: its last real token's vector (the one that has read the whole text, as transformers'
# LlamaForSequenceClassification reads it), or the mean of every real token's vector (after the final norm), which
# reads each word directly: on the task suite's lexical tasks, where the words a text uses decide its class, it
# scored higher (benchmarks/RESULTS.md, "Mean pooling").
POOLINGS = ("last", "mean")


def new_head(dim: int, num_classes: int, dtype: torch.dtype, device: torch.device | str) -> nn.Linear:
    """The head, small normal weights (std 0.02). The one place it is drawn, and always from the CPU's generator
    (then moved to `device`): a sharded run draws it on the CPU and keeps its rows (sharding.fresh_values), so a
    single process on a GPU, whose own generator would draw other numbers, starts from the same head."""
    if torch.device(device).type == "meta":
        return nn.Linear(dim, num_classes, bias=False, dtype=dtype, device=device)
    head = nn.Linear(dim, num_classes, bias=False, dtype=dtype, device="cpu")
    nn.init.normal_(head.weight, std=0.02)
    if torch.device(device).type != "cpu":  # a new parameter on the device, not Module.to: that swaps tensors in
        head.weight = nn.Parameter(head.weight.detach().to(device))  # place, which fake tensors (a simulation) refuse
    return head


class LlamaClassifier(nn.Module):
    """`Llama` + `head`, a linear map from the model width to `num_classes` scores.

    Build it after the backbone's weights are loaded: the head is created on the backbone's device and in its
    dtype (a float32 head on a bfloat16 backbone fails at the first matmul). `train_last=k` trains the head, the
    final norm and the last k blocks; `None` trains everything. With `lora`, those k blocks (None: every block)
    get LoRA adapters instead, and only the adapters train in them (lora.py): their weights and norms stay frozen,
    as does the embedding. The language-model output projection is never used here, so it is always frozen.

    `multi_label`: how the scores are read, a softmax over competing classes (one label per text) or a sigmoid per
    label (several: `--multi-label`). The head is the same either way; `classify.predict_proba` reads this.
    `pooling`: which vector the head reads (`POOLINGS`; `--pooling`), read by `forward` on every call.
    """

    def __init__(
        self,
        backbone: Llama,
        num_classes: int = 2,
        train_last: int | None = 2,
        lora: LoRASettings | None = None,
        multi_label: bool = False,
        pooling: str = "last",
    ):
        super().__init__()
        self.multi_label, self.pooling = multi_label, pooling
        if num_classes < 2:
            raise ValueError(f"num_classes must be at least 2, got {num_classes}")
        self.backbone = backbone
        like = backbone.final_norm.weight
        self.head = new_head(backbone.cfg.dim, num_classes, like.dtype, like.device)
        self.lora, self.lora_blocks = lora, []
        if lora is not None:  # the adapters are placed once, in the blocks that train
            self.lora_blocks = add_lora(backbone, lora, blocks=self.trained_blocks(train_last))
        self.train_last = train_last
        self.set_trainable(train_last)

    @property
    def pooling(self) -> str:
        return self._pooling

    @pooling.setter
    def pooling(self, value: str) -> None:
        """Checked wherever it is set, in the constructor or after a build (the command sets its --pooling, which a
        resumed run reads back from its recorded flags)."""
        if value not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {value!r}")
        self._pooling = value

    def trained_blocks(self, train_last: int | None) -> range:
        return trained_blocks(len(self.backbone.blocks), train_last)

    @property
    def frozen_blocks(self) -> int:
        """How many bottom blocks never change (0 when everything, the embedding included, trains): what the
        frozen-prefix cache may run once."""
        return self.trained_blocks(self.train_last).start

    def set_trainable(self, train_last: int | None) -> None:
        """Freeze everything, then unfreeze the head, the final norm and the last `train_last` blocks (None: all),
        or, with LoRA, their adapters only (which sit in the blocks chosen when the classifier was built)."""
        blocks = self.trained_blocks(train_last)
        if self.lora is not None and train_last != self.train_last:
            raise ValueError("the LoRA adapters were placed when the classifier was built: build a new one")
        everything = train_last is None and self.lora is None
        self.requires_grad_(everything)
        if self.lora is not None:
            for layer in lora_layers(self.backbone):
                layer.lora_a.requires_grad_(True)
                layer.lora_b.requires_grad_(True)
        elif not everything:
            for i in blocks:
                self.backbone.blocks[i].requires_grad_(True)
        self.backbone.final_norm.requires_grad_(True)
        self.head.requires_grad_(True)
        if not self.backbone.cfg.tie_embeddings:
            self.backbone.lm_head.requires_grad_(False)
        self.train_last = train_last

    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        """Name -> parameter for everything that trains: what the optimizer steps and the checkpoint saves."""
        return {name: p for name, p in self.named_parameters() if p.requires_grad}

    def frozen_prefix(self, input_ids: torch.Tensor, layout: Layout | None = None) -> torch.Tensor:
        """The residual stream after the frozen blocks (embedding, then blocks 0..frozen_blocks-1), as `forward`
        takes it back in `frozen_states`: [B, T, dim], or [1, N, dim] packed. `layout`: as `forward`'s.

        A method of the classifier, not of its backbone, so that a sharded classifier runs it as it runs `forward`
        (sharding.shard_model registers it with FSDP2): through the root module, whose hooks gather its own
        parameters (a tied embedding among them) and set FSDP up on first use, which a block run first would claim.
        """
        return self.backbone.run_blocks(self.backbone.embed_tokens(input_ids), layout, stop=self.frozen_blocks)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        frozen_states: torch.Tensor | None = None,
        *,
        layout: Layout | None = None,
    ) -> torch.Tensor:
        """[B, T] token ids and 1/0 mask -> [B, num_classes] class scores (logits).

        `frozen_states` [B, T, dim] replaces `input_ids` with the output of the frozen blocks, computed once
        beforehand (see `prefix_cache`), so that only the trained blocks run. `layout`, made where the batch was
        (`data.batching.to_batch`: packed texts, `input_ids` [1, N] or `frozen_states` [1, N, dim], or a padded
        batch whose padding side is known), replaces `attention_mask`, so the model never looks at the mask to
        find out how the batch was laid out.
        """
        if layout is not None and attention_mask is not None:
            raise ValueError("give the batch's attention_mask or its layout, not both")
        backbone = self.backbone
        x = backbone.embed_tokens(input_ids) if frozen_states is None else frozen_states
        layout = Layout.plain(attention_mask, x.shape[1], x.device) if layout is None else layout
        start = 0 if frozen_states is None else self.frozen_blocks  # frozen states: the trained blocks only
        if self.pooling == "mean":  # every token's vector is read, so the last block runs at every position
            hidden = backbone.final_norm(backbone.run_blocks(x, layout, start=start))
            return self.head(layout.text_means(hidden))
        # The head reads one vector per text, so the last block runs only at each text's last real token: its
        # query, attention output, feed-forward and all after run once per text instead of once per token (its
        # keys and values still come from every position). With train_last=1 that is most of the work.
        pooled = backbone.run_blocks(x, layout.at_last_tokens(), start=start)  # [B, 1, dim]; packed: [1, B, dim]
        return self.head(backbone.final_norm(pooled.flatten(0, 1)))
