"""A Llama backbone with a classification head: the vector of each text's last real token predicts its class."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .model import Block, Llama, apply_rotary


def last_real_positions(attention_mask: torch.Tensor | None, batch: int, seq_len: int, device) -> torch.Tensor:
    """[B] index of each row's last real token, whichever side the padding is on.

    In a causal model only the last token has read the whole text, so it is the one that can summarise it.
    """
    if attention_mask is None:
        return torch.full((batch,), seq_len - 1, device=device)
    positions = torch.arange(seq_len, device=device)
    return (attention_mask.to(device).long() * positions).argmax(-1)  # the largest position whose mask is 1


def last_real_token(hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """[B, T, dim] -> [B, dim]: the vector at each row's last real position."""
    last = last_real_positions(attention_mask, hidden.shape[0], hidden.shape[1], hidden.device)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


def last_block_at(
    block: Block, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attention_mask, last: torch.Tensor
) -> torch.Tensor:
    """The final block, computed only where the classifier reads it: each row's last real token. [B, dim]

    Its keys and values still come from every position, but its query, attention output, feed-forward and
    everything after run once per row instead of once per token. With `train_last=1` that is nearly all of the
    work that needs a backward pass. The result equals `Block.forward` at those positions.
    """
    attn, (B, T, _) = block.attention, x.shape
    rows = torch.arange(B, device=x.device)
    h = block.attention_norm(x)
    q = attn.q_proj(h[rows, last]).view(B, attn.n_heads, 1, attn.head_dim)  # one query per row
    k = attn.k_proj(h).view(B, T, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(h).view(B, T, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    cos, sin = rope  # [1 or B, 1, T, head_dim / 2]
    at_last = (cos.expand(B, -1, -1, -1)[rows, :, last, None], sin.expand(B, -1, -1, -1)[rows, :, last, None])
    q, k = apply_rotary(q, *at_last), apply_rotary(k, cos, sin)
    # The last real token may see every real token (all of them come at or before it).
    keys = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keys, enable_gqa=attn.n_kv_heads != attn.n_heads)
    x = x[rows, last] + attn.o_proj(out.reshape(B, -1))
    return x + block.ffn(block.ffn_norm(x))


class LlamaClassifier(nn.Module):
    """`Llama` + `head`, a linear map from the model width to `num_classes` scores.

    Build it after the backbone's weights are loaded: the head is created on the backbone's device and in its
    dtype (a float32 head on a bfloat16 backbone fails at the first matmul). `train_last=k` trains the head, the
    final norm and the last k blocks; `None` trains everything. The language-model output projection is never
    used here, so it is always frozen.
    """

    def __init__(self, backbone: Llama, num_classes: int = 2, train_last: int | None = 1):
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"num_classes must be at least 2, got {num_classes}")
        self.backbone = backbone
        like = backbone.final_norm.weight
        self.head = nn.Linear(backbone.cfg.dim, num_classes, bias=False, dtype=like.dtype, device=like.device)
        if not like.is_meta:
            nn.init.normal_(self.head.weight, std=0.02)
        self.train_last = train_last
        self.set_trainable(train_last)

    def set_trainable(self, train_last: int | None) -> None:
        """Freeze everything, then unfreeze the head, the final norm and the last `train_last` blocks (None: all)."""
        n_layers = len(self.backbone.blocks)
        if train_last is not None and not 0 <= train_last <= n_layers:
            raise ValueError(f"train_last must be between 0 and {n_layers} (the number of blocks), got {train_last}")
        everything = train_last is None
        self.requires_grad_(everything)
        if not everything:
            for block in self.backbone.blocks[n_layers - train_last :]:
                block.requires_grad_(True)
            self.backbone.final_norm.requires_grad_(True)
            self.head.requires_grad_(True)
        if not self.backbone.cfg.tie_embeddings:
            self.backbone.lm_head.requires_grad_(False)
        self.train_last = train_last

    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        """Name -> parameter for everything that trains: what the optimizer steps and the checkpoint saves."""
        return {name: p for name, p in self.named_parameters() if p.requires_grad}

    def forward(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        frozen_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B, T] token ids and 1/0 mask -> [B, num_classes] class scores (logits).

        `frozen_states` [B, T, dim] replaces `input_ids` with the output of the frozen blocks, computed once
        beforehand (see `prefix_cache`), so that only the trained blocks run.
        """
        backbone, n = self.backbone, len(self.backbone.blocks)
        x = backbone.embed_tokens(input_ids) if frozen_states is None else frozen_states
        start = 0 if frozen_states is None else n - self.train_last
        B, T = x.shape[:2]
        last = last_real_positions(attention_mask, B, T, x.device)
        if start < n:  # every block but the last at all positions, then the last only where we read it
            x = backbone.run_blocks(x, attention_mask, start=start, stop=n - 1)
            rope, _ = backbone.attention_inputs(attention_mask, T, x.device)
            pooled = last_block_at(backbone.blocks[-1], x, rope, attention_mask, last)
        else:  # train_last=0 with a cache: the cached states already passed every block
            pooled = x[torch.arange(B, device=x.device), last]
        return self.head(backbone.final_norm(pooled))
