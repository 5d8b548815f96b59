"""Your Llama-3: the model the chapters build, in one file, top to bottom.

token ids -> embedding -> n_layers x Block(RMSNorm -> attention -> add, RMSNorm -> feed-forward -> add)
          -> final RMSNorm -> output projection -> next-token logits

Chapter 2 reads RMSNorm and the rotary embedding, chapter 3 attention, chapter 4 the feed-forward layer, the block
and the whole model. Chapter 6 loads SmolLM2's weights into `OurLlama` (its loop is `load_checkpoint`, at the end),
chapter 7 puts the head on it (`OurClassifier`), chapter 8 trains that on SMS spam, chapter 10 generates text with
`generate`. Each of those chapters checks it against the package, `llama_scratch`, and so does
`tests/chapters/test_our_llama.py`. Change anything here and they tell you whether it still computes Llama-3.

What it leaves to the package, each time for the simplest code that computes the same numbers:
- Attention is written out (scores, mask, softmax, weighted values: chapter 3) where the package calls the fused
  `F.scaled_dot_product_attention`. Equal up to float rounding; every step visible; the scores of all query-key
  pairs are held at once, which is fine for the short texts of the chapters.
- Every forward builds its mask, causal and padding alike (chapter 3); the package skips it where it can.
- No key/value cache: `generate` reruns the whole text for each new token. A few dozen tokens of a small model
  take seconds that way, and a cache would thread positions and stored keys through every class below; chapter
  10 builds one step by step and measures what it saves.
- No LoRA, packing, gradient checkpointing or frozen-prefix cache: the package's additions for speed and memory.

Parameter names are the package's (`blocks.0.attention.q_proj.weight`), not Hugging Face's
(`model.layers.0.self_attn.q_proj.weight`): the package's state dict then loads into this model as it is, with
`strict=True` checking every name and shape, and a checkpoint's names map here through the package's one
translation, `llama_scratch.checkpoints.hf_layout.hf_to_ours` (chapter 6).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from llama_scratch.checkpoints.hf_layout import hf_to_ours  # a checkpoint's tensor names -> ours (chapter 6)
from llama_scratch.model.config import LlamaConfig, RopeScaling  # only numbers: widths, heads, theta, ...


class RMSNorm(nn.Module):
    """Divide each vector by its root mean square, then multiply by a learned gain per channel. No mean, no bias."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32: a bfloat16 mean of squares loses digits (chapter 2 measures it). Round back, then the gain.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """How fast each channel pair turns, in radians per position: head_dim // 2 values, float32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling is None:
        return inv_freq
    # Llama 3.1 (chapter 2, section 3): pairs whose wavelength is under context / high_freq_factor keep their speed
    # (smooth >= 1), those over context / low_freq_factor turn `factor` times slower (smooth <= 0), and those in
    # between are blended.
    wavelen = 2 * math.pi / inv_freq
    context = scaling.original_max_position_embeddings
    smooth = (context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smooth = smooth.clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq


def rope_angles(positions: torch.Tensor, cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> cos and sin of every pair's angle, [B, 1, T, head_dim // 2] (1: broadcast over heads).

    Recomputed at every forward (a few thousand numbers): nothing is stored, so nothing needs recomputing when the
    model is built on the meta device (chapter 6) or moved to another device or dtype.
    """
    inv_freq = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(positions.device)
    angles = positions.float()[..., None] * inv_freq  # position p turns pair i by p * inv_freq[i]
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel i of each head against channel i + head_dim / 2 (the Hugging Face layout) by its angle.

    x [B, heads, T, head_dim]. Computed in float32 and rounded once, as RMSNorm is.
    """
    first, second = x.float().chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention: n_heads query heads share n_kv_heads key/value heads."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False, dtype=cfg.dtype)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False, dtype=cfg.dtype)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False, dtype=cfg.dtype)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False, dtype=cfg.dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, dim] -> [B, T, dim]. mask [B, 1, T, T]: True where query t may look at key s."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, heads, T, head_dim]
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, kv_heads, T, head_dim]
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = self.n_heads // self.n_kv_heads  # query heads h = g * group ... g * group + group - 1 read kv head g
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # [B, heads, T, T]: query t against key s
        scores = scores.masked_fill(~mask, float("-inf"))  # keys a query may not see get weight exactly 0
        weights = scores.float().softmax(dim=-1).to(v.dtype)  # the softmax in float32 for bfloat16 models
        out = (weights @ v).transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # the heads side by side
        return self.o_proj(out)


class FeedForward(nn.Module):
    """SwiGLU: a SiLU-activated gate multiplies an 'up' projection, then 'down' returns to the model's width."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False, dtype=cfg.dtype)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False, dtype=cfg.dtype)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False, dtype=cfg.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One layer: normalise, attend, add back to the residual stream; normalise, feed forward, add back."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.dtype)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.dtype)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.ffn(self.ffn_norm(x))


class OurLlama(nn.Module):
    """The whole network: embedding, blocks, final norm, and the output projection to next-token logits."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim, dtype=cfg.dtype)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.final_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.dtype)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False, dtype=cfg.dtype)
        if cfg.tie_embeddings:  # Llama-3.2 1B and 3B, SmolLM2: one matrix reads tokens in and scores them out
            self.lm_head.weight = self.embed_tokens.weight
        for module in self.modules():  # small random weights to start from; loaded weights replace them
            if isinstance(module, (nn.Linear, nn.Embedding)) and not module.weight.is_meta:
                nn.init.normal_(module.weight, std=0.02)

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T] token ids (attention_mask [B, T]: 1 real, 0 pad) -> [B, T, dim], after the final norm.

        Padding on either side gives each real token what it gets without padding (chapter 3): positions count
        real tokens only, and the mask hides the pads from the real tokens.
        """
        B, T = input_ids.shape
        device = input_ids.device
        if attention_mask is None:
            real = torch.ones(B, T, dtype=torch.bool, device=device)
        else:
            real = attention_mask.to(device=device, dtype=torch.bool)
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)  # 0 at each text's first real token
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        itself = torch.eye(T, dtype=torch.bool, device=device)  # a pad sees itself: no row of the mask is empty
        mask = ((causal & real[:, None, :]) | itself)[:, None]  # [B, 1, T, T], the same for every head
        cos, sin = rope_angles(positions, self.cfg)
        x = self.embed_tokens(input_ids)  # [B, T, dim]: the residual stream
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        return self.final_norm(x)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token logits [B, T, vocab_size]."""
        return self.lm_head(self.hidden_states(input_ids, attention_mask))


@torch.no_grad()
def generate(model: OurLlama, prompt: list[int], new_tokens: int, stop_ids: Collection[int] = ()) -> list[int]:
    """Greedy decoding (chapter 10): up to `new_tokens` most likely next tokens, stopping after any of `stop_ids`.

    The whole text is run again for each token (no cache, see the module's docstring).
    """
    device = model.embed_tokens.weight.device
    text = list(prompt)
    for _ in range(new_tokens):
        logits = model(torch.tensor([text], device=device))[0, -1]  # the last position's scores
        text.append(int(logits.argmax()))
        if text[-1] in stop_ids:
            break
    return text[len(prompt) :]


class OurClassifier(nn.Module):
    """`OurLlama` + `head`, a linear map from the model's width to one score per class (chapter 7).

    The head reads each text's last real token: in a causal model only that one has read the whole text.
    `train_last=k` trains the head, the final norm and the last k blocks (None: everything); the output
    projection is never used here, so it never trains.
    """

    def __init__(self, backbone: OurLlama, num_classes: int = 2, train_last: int | None = 2):
        super().__init__()
        self.backbone = backbone
        like = backbone.final_norm.weight  # the head in the backbone's dtype and on its device (chapter 7)
        self.head = nn.Linear(backbone.cfg.dim, num_classes, bias=False, dtype=like.dtype, device=like.device)
        nn.init.normal_(self.head.weight, std=0.02)
        self.requires_grad_(train_last is None)
        if train_last is not None:
            for block in backbone.blocks[len(backbone.blocks) - train_last :]:
                block.requires_grad_(True)
        backbone.final_norm.requires_grad_(True)
        self.head.requires_grad_(True)
        if not backbone.cfg.tie_embeddings:
            backbone.lm_head.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T] token ids and 1/0 mask -> [B, num_classes] class scores (logits)."""
        hidden = self.backbone.hidden_states(input_ids, attention_mask)  # [B, T, dim]
        B, T = input_ids.shape
        if attention_mask is None:
            last = torch.full((B,), T - 1, device=hidden.device)
        else:  # the largest position whose mask is 1, whichever side the padding is on
            last = (attention_mask.to(hidden.device).long() * torch.arange(T, device=hidden.device)).argmax(-1)
        return self.head(hidden[torch.arange(B, device=hidden.device), last])


def load_checkpoint(checkpoint: str | Path, dtype: torch.dtype = torch.float32) -> OurLlama:
    """A Hugging Face-layout checkpoint directory (config.json and *.safetensors) as an `OurLlama` in `dtype`.

    Chapter 6's streaming loader, kept here so that a later chapter builds your model from real weights in one
    line: the model is made on the meta device (no memory, no random values), then each tensor of each file is
    read alone, converted and put in place under its name, so memory holds the model and one tensor in transit.
    """
    checkpoint = Path(checkpoint)
    cfg = dataclasses.replace(LlamaConfig.from_hf(checkpoint), dtype=dtype)
    with torch.device("meta"):
        model = OurLlama(cfg)
    for shard in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:  # reads the header only
            for hf_name in f.keys():  # noqa: SIM118 (safe_open has keys() but cannot be iterated)
                module_name, _, attr = hf_to_ours(hf_name).rpartition(".")
                tensor = f.get_tensor(hf_name).to(dtype)  # reads this tensor's bytes
                setattr(model.get_submodule(module_name), attr, nn.Parameter(tensor))
    if cfg.tie_embeddings:  # the file holds the shared matrix once, as the embedding
        model.lm_head.weight = model.embed_tokens.weight
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{checkpoint} holds no tensor for {', '.join(missing[:3])}")
    return model
