"""What one block of the classifier saves for backward and the temporaries it makes, in bytes (for plan.py).

Each term names the tensor autograd saves, operation by operation (tests/planning/test_plan.py checks the sums against
`torch.autograd.graph.saved_tensors_hooks`, for padded and packed batches). A trained block saves the same tensors
whether its weights train or LoRA adapters do, except for what the weights' gradients read: see
`projection_inputs_bytes`.

A batch is a `BatchShape`. Training packs its texts (model/packing.py): norms, projections and the feed-forward run on
the real tokens only, attention on a right-padded copy of texts x longest slots. So some terms grow with the
tokens and others with the slots, and the packing itself keeps tensors a padded batch does not have.
"""

from __future__ import annotations

from typing import NamedTuple

from ..model.config import LlamaConfig
from ..model.lora import LoRASettings

FP32 = 4  # bytes: RMSNorm and rotary embedding compute in float32 whatever the parameter dtype
INT64 = 8  # bytes: token ids and the packed layout's indices


class BatchShape(NamedTuple):
    """A micro-batch as memory sees it: `texts` rows (padded) or texts (packed), the longest `longest` tokens, and
    `tokens` real tokens in all (a padded batch: texts x longest, every position computed)."""

    texts: int
    longest: int
    tokens: int
    packed: bool

    @property
    def slots(self) -> int:
        """Positions attention computes: the padded batch itself, or (packed) its right-padded copy of the texts."""
        return self.texts * self.longest

    @classmethod
    def padded(cls, batch: int, seq: int) -> BatchShape:
        return cls(batch, seq, batch * seq, packed=False)


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
    """What the gradients of a block's projections (`reads`, by lora.TARGETS name: all seven, or one half's) and norm
    gains read.

    Trained weights read every input, each tensor saved once, and the gains read the norms' normalised vectors
    (`normed` elements). With LoRA the weights and gains are frozen: each adapted projection keeps its input (for
    A's gradient) and its [rows, rank] A x (for B's). With dropout, each adapter keeps its own dropped input
    instead, and, where gradients flow through it, the dropout mask (1 byte on CUDA's fused kernel, the input's
    dtype on CPU). Planned as if gradients flowed through every operation of the block: exact for the default
    targets (all seven), an overestimate for some subsets (tests/planning/test_plan.py measures both).
    """

    def once(entries) -> int:
        return sum({r.tensor: r.rows * r.width for r in entries if not r.kept_anyway}.values())

    if lora is None:
        return itemsize * (normed + once(reads.values()))
    adapted = [reads[t] for t in lora.targets if t in reads]
    low_rank = sum(itemsize * r.rows * lora.rank for r in adapted)
    if lora.dropout:
        mask = 1 if cuda else itemsize
        return low_rank + sum((itemsize + (mask if r.needs_grad else 0)) * r.rows * r.width for r in adapted)
    return low_rank + itemsize * once(adapted)


class BlockSaved(NamedTuple):
    """What a trained block saves, by the half of the block that reads it in backward (model.Block)."""

    attention: int  # the attention norm, attention and what q, k, v and o read
    feed_forward: int  # the feed-forward norm, the SwiGLU and what gate, up and down read
    ffn_norm: int  # of `feed_forward`, what is still alive when the feed-forward norm's backward runs

    @property
    def total(self) -> int:
        return self.attention + self.feed_forward


def block_saved(
    cfg: LlamaConfig,
    b: BatchShape,
    itemsize: int,
    input_grad: bool,
    device_type: str,
    lora: LoRASettings | None = None,
) -> BlockSaved:
    """Bytes one trained block saves for backward (see model.Block), at parameter size `itemsize`.

    `input_grad`: whether the block's input needs a gradient. The lowest trained block's input comes from frozen
    layers, so its first norm keeps only what its gain's gradient (or its adapters) need.
    """
    n, d, f = b.tokens, cfg.dim, cfg.ffn_dim
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    # RMSNorm: the float32 input (for x.pow) and 1/rms, only when the input needs a gradient.
    norm_for_input = FP32 * n * d + FP32 * n
    # Attention: SDPA (flash) keeps q and k after rotation, v, its output and the log-sum-exp of each query row, at
    # every slot it computes (packed: the texts' right-padded copy, padding included). Rotary keeps only its
    # cos/sin tables (shared by all blocks, see outside_blocks_saved_bytes).
    attention = itemsize * b.slots * (2 * q + 2 * kv) + FP32 * cfg.n_heads * b.slots
    if b.packed:
        # Packed.pad copies the stream into the padded layout with index_copy, whose backward keeps its source: the
        # packed q (after rotation), k and v stay alive beside the kernel's padded copies of them.
        attention += itemsize * n * (q + 2 * kv)
    # SwiGLU: gate output (for silu), silu(gate) and up (for the product).
    ffn = 3 * itemsize * n * f
    # What the projections read: the norms' outputs, o_proj's input and the SwiGLU product. o_proj's input is the
    # kernel's saved output itself only for a padded batch on CUDA ([B, T, H, hd] in memory, so the reshape is a
    # view); on CPU the kernel's output is [B, H, T, hd] and the reshape copies, and packed, Packed.unpad gathers
    # the real tokens into a new [tokens, q] tensor. The gains read their norm's normalised vector.
    cuda = device_type == "cuda"
    reads = {t: Read("attention norm", n, d, needs_grad=input_grad) for t in ("q", "k", "v")}
    reads["o"] = Read("o input", n, q, kept_anyway=cuda and not b.packed)
    attention += projection_inputs_bytes(reads, n * d, itemsize, lora, cuda)
    reads = {"down": Read("product", n, f)} | {t: Read("ffn norm", n, d) for t in ("gate", "up")}
    ffn += projection_inputs_bytes(reads, n * d, itemsize, lora, cuda)
    # The feed-forward norm's backward comes after gate's and up's: its input, 1/rms and (a trained gain) its
    # normalised vector are what is left of the feed-forward half.
    ffn_norm = norm_for_input + (itemsize * n * d if lora is None else 0)
    return BlockSaved((norm_for_input if input_grad else 0) + attention, norm_for_input + ffn, ffn_norm)


def last_block_saved_bytes(
    cfg: LlamaConfig,
    b: BatchShape,
    itemsize: int,
    input_grad: bool,
    device_type: str,
    lora: LoRASettings | None = None,
) -> int:
    """Bytes the classifier's last block saves. It runs only where the classifier reads it (`Block` at its
    layout's query rows): its attention norm and keys and values at every position, the rest at each text's last
    token."""
    n, rows, d, f = b.tokens, b.texts, cfg.dim, cfg.ffn_dim
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    # Every position: the attention norm's float32 input and 1/rms, if its input needs a gradient.
    everywhere = (FP32 * n * d + FP32 * n) if input_grad else 0
    if device_type == "cuda":
        # A padded batch gives the pooled rows a key mask, and with a mask the model repeats keys and values for
        # every query head (model.attention_kernels.sdpa); a packed one always has one (Packed.last_sees: each text's
        # own keys). Planned as SDPA's math kernel, the worst case (float32 copies of them over every slot, kept
        # with the float32 query and the softmax); the memory-efficient kernel keeps the repeated keys and values
        # in the model's dtype: less. Unmeasured on a GPU.
        everywhere += 2 * FP32 * b.slots * q
        attention = FP32 * rows * q + FP32 * rows * cfg.n_heads * b.longest
    elif b.packed:
        # The texts' last tokens see only their own keys: a mask (kept by the kernel, in the model's dtype, one
        # value a slot), so keys and values are repeated for every query head and kept so; q, out, log-sum-exp.
        everywhere += 2 * itemsize * b.slots * q + itemsize * b.slots
        attention = 2 * itemsize * rows * q + FP32 * rows * cfg.n_heads
    else:
        # Without padding (as planned here) each row's last token is the last position and sees every key: no mask,
        # so the kernel keeps k and v as they are, q, out and the log-sum-exp. (With padding: a mask, and keys and
        # values repeated for every query head, 2 * itemsize * n * (q - kv) more.)
        everywhere += 2 * itemsize * n * kv
        attention = 2 * itemsize * rows * q + FP32 * rows * cfg.n_heads
    if b.packed:
        everywhere += 2 * itemsize * n * kv  # Packed.pad's index_copy keeps its sources: the packed k and v
    # One row each: row and position indices, cos/sin at the last token, the feed-forward norm's float32 input and
    # 1/rms, and three of the SwiGLU's [ffn_dim] vectors.
    per_row = 16 * rows + FP32 * rows * cfg.head_dim + FP32 * rows * (d + 1) + 3 * itemsize * rows * f
    # What the projections read: k and v the attention norm's output at every position, q that output at the
    # pooled rows (a copy), o the kernel's output (on CUDA a copy of the math kernel's float32 one; packed, a copy
    # of the [texts, heads, 1, head_dim] output turned back into one row per text), gate and up the feed-forward
    # norm's output, down the SwiGLU product.
    reads = {"q": Read("q input", rows, d, needs_grad=input_grad)}
    reads |= {t: Read("attention norm", n, d, needs_grad=input_grad) for t in ("k", "v")}
    o_is_kernel_output = device_type != "cuda" and not b.packed
    reads |= {"o": Read("o input", rows, q, kept_anyway=o_is_kernel_output), "down": Read("product", rows, f)}
    reads |= {t: Read("ffn norm", rows, d) for t in ("gate", "up")}
    projections = projection_inputs_bytes(reads, n * d + rows * d, itemsize, lora, device_type == "cuda")
    return everywhere + attention + per_row + projections


def block_forward_work(cfg: LlamaConfig, b: BatchShape, itemsize: int) -> int:
    """Temporaries at the peak of a forward through a block that saves nothing (frozen, or checkpointed).

    The SwiGLU product is the largest step: silu(gate), up and their product, with the block's input, its
    mid-block residual, the norm output and attention's output (Block.forward's name for it keeps it until the block
    returns) alive around it. Attention's peak is the float32 rotary arithmetic on q; packed, it may come later,
    when Packed.unpad has copied the kernel's output back beside the padded q, k, v and that output. Throughout: the
    rotary tables, and the embedding output, which the classifier holds until the blocks return (measured on CPU).
    """
    n, p, d, f = b.tokens, b.slots, cfg.dim, cfg.ffn_dim
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    ffn = 3 * itemsize * n * f + 4 * itemsize * n * d
    if b.packed:  # the padded k and v exist from before q's rotary arithmetic
        rotary = itemsize * (2 * p * kv + n * q) + 3 * FP32 * n * q
        attention = 2 * itemsize * n * d + max(rotary, itemsize * p * (2 * q + 2 * kv) + itemsize * n * q)
    else:
        attention = 2 * itemsize * n * d + itemsize * n * (q + 2 * kv) + 3 * FP32 * n * q
    norm = norm_forward_work(cfg, b, itemsize)
    return max(ffn, attention, norm) + FP32 * n * cfg.head_dim + itemsize * n * d


def norm_forward_work(cfg: LlamaConfig, b: BatchShape, itemsize: int) -> int:
    """Temporaries of an RMSNorm run at every token: its float32 arithmetic beside its input and output. A block's
    two norms, and under --pooling mean the final norm, after the blocks."""
    n, d = b.tokens, cfg.dim
    return 3 * FP32 * n * d + 2 * itemsize * n * d


def trained_forward_work(cfg: LlamaConfig, b: BatchShape) -> int:
    """Temporaries of a trained block's forward beyond what it saves: the float32 rotary arithmetic on q."""
    return 2 * FP32 * b.tokens * cfg.n_heads * cfg.head_dim


def backward_work(
    cfg: LlamaConfig, b: BatchShape, itemsize: int, device_type: str, lora: bool = False
) -> dict[str, int]:
    """Gradient temporaries of a block's backward beyond its saved tensors and weight gradients, at its two peaks.

    start: the gradient flowing down the residual stream and two of the SwiGLU's [tokens, ffn_dim] gradients (or
    flash attention's dq, dk, dv over all heads and its float32 dq accumulator, if larger: over every slot, and
    packed, beside the output's gradient scattered into the padded layout by Packed.unpad's backward); with LoRA a
    third: the gradient of down's input comes in two parts, through the frozen weight and through the adapter, then
    summed (measured on CPU). end: the attention norm's float32 arithmetic (five [tokens, dim] float32 tensors when
    its input needs a gradient, measured) and the gradient of the block's input. The last block's start is small
    unless keys and values were repeated for every query head (a mask: always when packed), when their gradients
    span every slot and head (on CUDA the math kernel's float32 dk and dv over all heads, planned for any batch).
    """
    n, p, d, f = b.tokens, b.slots, cfg.dim, cfg.ffn_dim
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    if device_type == "cuda" or not b.packed:  # (a padded batch on CPU: planned as flash, on the safe side)
        attention = 3 * itemsize * p * q + FP32 * p * q + (itemsize * p * q if b.packed else 0)
    else:  # the CPU kernel shares key/value heads itself: dq over all heads, dk and dv over theirs (measured)
        attention = itemsize * p * (2 * q + 2 * kv)
    if device_type == "cuda":
        last_start = 2 * FP32 * p * q
    else:
        last_start = 2 * itemsize * p * q if b.packed else 2 * itemsize * n * kv
    return {
        "start": itemsize * n * d + max((3 if lora else 2) * itemsize * n * f, attention),
        "last start": last_start,
        "end": 5 * FP32 * n * d + itemsize * n * d,
        "end, input frozen": 2 * itemsize * n * d,
    }


def norm_saved_bytes(cfg: LlamaConfig, b: BatchShape, itemsize: int, input_grad: bool, lora: bool) -> int:
    """What a block's attention norm saves (the last thing its backward reaches): its output, its normalised vector
    unless its gain is frozen (LoRA), and its float32 input and 1/rms if its input needs a gradient."""
    n, d = b.tokens, cfg.dim
    return (1 if lora else 2) * itemsize * n * d + ((FP32 * n * d + FP32 * n) if input_grad else 0)


def outside_blocks_saved_bytes(
    cfg: LlamaConfig,
    b: BatchShape,
    itemsize: int,
    trained_blocks: int,
    num_classes: int,
    embedding_trains: bool,
    pooling: str = "last",
) -> dict[str, int]:
    """Saved tensors outside the blocks: rotary tables, final norm, head, loss."""
    n, rows, d = b.tokens, b.texts, cfg.dim
    out = {}
    # Rotary cos and sin, [B, 1, T, head_dim / 2] float32 each (training passes an attention mask or a packed layout:
    # per-token positions), one pair for every block (Llama.run_blocks computes them once per forward).
    out["rotary tables"] = FP32 * n * cfg.head_dim * min(trained_blocks, 1)
    # Final norm at each row's last token (--pooling mean: at every token, which the mean then reads); its input
    # needs a gradient only if the last block trains.
    at = n if pooling == "mean" else rows
    out["final norm"] = itemsize * at * d + ((FP32 * at * d + FP32 * at) if trained_blocks else 0)
    # Head input (the final norm's output), the float32 logits' log-softmax.
    out["head"] = itemsize * rows * d + 2 * FP32 * rows * num_classes
    if b.packed:
        # A packed batch's ints (labels, token ids, and the layout's counts, positions, slots and last tokens) are
        # views of one int64 tensor (packing.to_device). The loss keeps the labels and Packed.pad the slots: the
        # whole tensor stays.
        out["batch ints"] = INT64 * (3 * n + 3 * rows)
    elif embedding_trains:
        out["token ids"] = INT64 * n  # the embedding keeps its int64 indices
    return out
