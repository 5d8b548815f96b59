"""What one block of the classifier saves for backward and the temporaries it makes, in bytes (for plan.py).

Each term names the tensor autograd saves, operation by operation (tests/test_plan.py checks the sums against
`torch.autograd.graph.saved_tensors_hooks`). A trained block saves the same tensors whether its weights train
or LoRA adapters do, except for what the weights' gradients read: see `projection_inputs_bytes`.
"""

from __future__ import annotations

from typing import NamedTuple

from ..model.config import LlamaConfig
from ..model.lora import LoRASettings

FP32 = 4  # bytes: RMSNorm and rotary embedding compute in float32 whatever the parameter dtype


class Read(NamedTuple):
    """A tensor that a projection reads, as its gradients need it kept."""

    tensor: str  # which one: several projections may read the same tensor (q, k and v the norm's output)
    rows: int
    width: int
    kept_anyway: bool = False  # another operation saves it already
    needs_grad: bool = True  # gradients flow back through it (not so below frozen layers and a frozen norm)


def projection_inputs_bytes(
    reads: dict[str, Read], normed: int, itemsize: int, lora: LoRASettings | None, cuda: bool
) -> int:
    """What the gradients of a block's seven projections (`reads`, by lora.TARGETS name) and two norm gains read.

    Trained weights read every input, each tensor saved once, and the gains read the norms' normalised vectors
    (`normed` elements). With LoRA the weights and gains are frozen: each adapted projection keeps its input (for
    A's gradient) and its [rows, rank] A x (for B's). With dropout, each adapter keeps its own dropped input
    instead, and, where gradients flow through it, the dropout mask (1 byte on CUDA's fused kernel, the input's
    dtype on CPU). Planned as if gradients flowed through every operation of the block: exact for the default
    targets (all seven), an overestimate for some subsets (tests/test_plan.py measures both).
    """

    def once(entries) -> int:
        return sum({r.tensor: r.rows * r.width for r in entries if not r.kept_anyway}.values())

    if lora is None:
        return itemsize * (normed + once(reads.values()))
    adapted = [reads[t] for t in lora.targets]
    low_rank = sum(itemsize * r.rows * lora.rank for r in adapted)
    if lora.dropout:
        mask = 1 if cuda else itemsize
        return low_rank + sum((itemsize + (mask if r.needs_grad else 0)) * r.rows * r.width for r in adapted)
    return low_rank + itemsize * once(adapted)


def block_saved_bytes(
    cfg: LlamaConfig,
    batch: int,
    seq: int,
    itemsize: int,
    input_grad: bool,
    device_type: str,
    lora: LoRASettings | None = None,
) -> int:
    """Bytes one trained block saves for backward (see model.Block), at parameter size `itemsize`.

    `input_grad`: whether the block's input needs a gradient. The lowest trained block's input comes from frozen
    layers, so its first norm keeps only what its gain's gradient (or its adapters) need.
    """
    n, d, f = batch * seq, cfg.dim, cfg.ffn_dim
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    # RMSNorm: the float32 input (for x.pow) and 1/rms, only when the input needs a gradient.
    norm_for_input = FP32 * n * d + FP32 * n
    # Attention: SDPA (flash) keeps q and k after rotation, v, its output and the log-sum-exp of each query row.
    # Rotary keeps only its cos/sin tables (shared by all blocks, see outside_blocks_saved_bytes).
    attention = itemsize * n * (2 * q + 2 * kv) + FP32 * batch * cfg.n_heads * seq
    # SwiGLU: gate output (for silu), silu(gate) and up (for the product).
    ffn = 3 * itemsize * n * f
    # What the projections read: the norms' outputs, o_proj's input (a copy on CPU, where the kernel's output is
    # [B, H, T, hd]; on CUDA the kernel's saved output itself) and the SwiGLU product.
    reads = {t: Read("attention norm", n, d, needs_grad=input_grad) for t in ("q", "k", "v")}
    reads |= {"o": Read("o input", n, q, kept_anyway=device_type == "cuda"), "down": Read("product", n, f)}
    reads |= {t: Read("ffn norm", n, d) for t in ("gate", "up")}
    projections = projection_inputs_bytes(reads, 2 * n * d, itemsize, lora, device_type == "cuda")
    return (norm_for_input if input_grad else 0) + attention + norm_for_input + ffn + projections


def last_block_saved_bytes(
    cfg: LlamaConfig,
    batch: int,
    seq: int,
    itemsize: int,
    input_grad: bool,
    device_type: str,
    lora: LoRASettings | None = None,
) -> int:
    """Bytes the classifier's last block saves. It runs only where the classifier reads it (`Block` with
    `query_rows`): its attention norm and keys and values at every position, the rest at each row's last real token."""
    n, b, d, f = batch * seq, batch, cfg.dim, cfg.ffn_dim
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    # Every position: the attention norm's float32 input and 1/rms, if its input needs a gradient.
    everywhere = (FP32 * n * d + FP32 * n) if input_grad else 0
    if device_type == "cuda":
        # A padded batch gives the pooled rows a key mask, and with a mask the model repeats keys and values for
        # every query head (model.Attention.attend). Planned as SDPA's math kernel, the worst case (float32 copies
        # of them, kept with the float32 query and the softmax); the memory-efficient kernel keeps the repeated
        # keys and values in the model's dtype: less. Unmeasured on a GPU.
        everywhere += 2 * FP32 * n * q
        attention = FP32 * b * q + FP32 * b * cfg.n_heads * seq
    else:
        # Without padding (as planned here) each row's last token is the last position and sees every key: no mask,
        # so the kernel keeps k and v as they are, q, out and the log-sum-exp. (With padding: a mask, and keys and
        # values repeated for every query head, 2 * itemsize * n * (q - kv) more.)
        everywhere += 2 * itemsize * n * kv
        attention = 2 * itemsize * b * q + FP32 * b * cfg.n_heads
    # One row each: row and position indices, cos/sin at the last token, the feed-forward norm's float32 input and
    # 1/rms, and three of the SwiGLU's [ffn_dim] vectors.
    rows = 16 * b + FP32 * b * cfg.head_dim + FP32 * b * (d + 1) + 3 * itemsize * b * f
    # What the projections read: k and v the attention norm's output at every position, q that output at the
    # pooled rows (a copy), o the kernel's output (on CUDA a copy of the math kernel's float32 one), gate and up
    # the feed-forward norm's output, down the SwiGLU product.
    reads = {"q": Read("q input", b, d, needs_grad=input_grad)}
    reads |= {t: Read("attention norm", n, d, needs_grad=input_grad) for t in ("k", "v")}
    reads |= {"o": Read("o input", b, q, kept_anyway=device_type != "cuda"), "down": Read("product", b, f)}
    reads |= {t: Read("ffn norm", b, d) for t in ("gate", "up")}
    projections = projection_inputs_bytes(reads, n * d + b * d, itemsize, lora, device_type == "cuda")
    return everywhere + attention + rows + projections


def block_forward_work(cfg: LlamaConfig, batch: int, seq: int, itemsize: int) -> int:
    """Temporaries at the peak of a forward through a block that saves nothing (frozen, or checkpointed).

    The SwiGLU product is the largest step: silu(gate), up and their product, with the block's input, its
    mid-block residual and the norm output alive around it. Attention's peak is the float32 rotary arithmetic.
    Throughout: the rotary tables, and the embedding output, which the classifier holds until the blocks return.
    """
    n, d, f = batch * seq, cfg.dim, cfg.ffn_dim
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    ffn = 3 * itemsize * n * f + 3 * itemsize * n * d
    attention = 2 * itemsize * n * d + itemsize * n * (q + 2 * kv) + 3 * FP32 * n * q
    norm = 3 * FP32 * n * d + 2 * itemsize * n * d
    return max(ffn, attention, norm) + FP32 * n * cfg.head_dim + itemsize * n * d


def trained_forward_work(cfg: LlamaConfig, batch: int, seq: int) -> int:
    """Temporaries of a trained block's forward beyond what it saves: the float32 rotary arithmetic on q."""
    return 2 * FP32 * batch * seq * cfg.n_heads * cfg.head_dim


def backward_work(
    cfg: LlamaConfig, batch: int, seq: int, itemsize: int, device_type: str, lora: bool = False
) -> dict[str, int]:
    """Gradient temporaries of a block's backward beyond its saved tensors and weight gradients, at its two peaks.

    start: the gradient flowing down the residual stream and two of the SwiGLU's [tokens, ffn_dim] gradients (or
    flash attention's dq, dk, dv over all heads and its float32 dq accumulator, if larger); with LoRA a third: the
    gradient of down's input comes in two parts, through the frozen weight and through the adapter, then summed
    (measured on CPU). end: the attention
    norm's float32 arithmetic (five [tokens, dim] float32 tensors when its input needs a gradient, measured) and
    the gradient of the block's input. The last block's start is small: only its keys and values span every
    position (on CUDA the math kernel's float32 dk and dv over all heads).
    """
    n, d, f = batch * seq, cfg.dim, cfg.ffn_dim
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return {
        "start": itemsize * n * d + max((3 if lora else 2) * itemsize * n * f, 3 * itemsize * n * q + FP32 * n * q),
        "last start": 2 * FP32 * n * q if device_type == "cuda" else 2 * itemsize * n * kv,
        "end": 5 * FP32 * n * d + itemsize * n * d,
        "end, input frozen": 2 * itemsize * n * d,
    }


def norm_saved_bytes(cfg: LlamaConfig, batch: int, seq: int, itemsize: int, input_grad: bool, lora: bool) -> int:
    """What a block's attention norm saves (the last thing its backward reaches): its output, its normalised vector
    unless its gain is frozen (LoRA), and its float32 input and 1/rms if its input needs a gradient."""
    n, d = batch * seq, cfg.dim
    return (1 if lora else 2) * itemsize * n * d + ((FP32 * n * d + FP32 * n) if input_grad else 0)


def outside_blocks_saved_bytes(
    cfg: LlamaConfig, b: int, t: int, itemsize: int, trained_blocks: int, num_classes: int, embedding_trains: bool
) -> dict[str, int]:
    """Saved tensors outside the blocks: rotary tables, final norm, head, loss."""
    n, d = b * t, cfg.dim
    out = {}
    # Rotary cos and sin, [B, 1, T, head_dim / 2] float32 each (training passes an attention mask: per-row positions),
    # one pair for every block (Llama.run_blocks computes them once per forward).
    out["rotary tables"] = FP32 * n * cfg.head_dim * min(trained_blocks, 1)
    # Final norm at each row's last token; its input needs a gradient only if the last block trains.
    out["final norm"] = itemsize * b * d + ((FP32 * b * d + FP32 * b) if trained_blocks else 0)
    # Head input (the final norm's output), the float32 logits' log-softmax.
    out["head"] = itemsize * b * d + 2 * FP32 * b * num_classes
    if embedding_trains:
        out["token ids"] = 8 * n  # the embedding keeps its int64 indices
    return out
