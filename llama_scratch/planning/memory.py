"""Memory planning: what one training process holds on its GPU, worked out before anything is allocated.

Parameter counts come from the model built on the meta device, so they are exact (LoRA adapters, their gradients
and optimizer state included). Activation sizes come from the model's own operations: each term (in
plan_activations.py, and outside the blocks here) names the tensor autograd saves for backward (checked against
`torch.autograd.graph.saved_tensors_hooks` in tests/planning/test_plan.py), for full blocks and for the classifier's
last block, which runs only at each row's last token when the head reads that token (`--pooling last`, the default);
under `--pooling mean` it reads every token, so the last block is a full one. Working memory of a forward or backward
step (tensors that live for one operation) is an estimate from the same shapes, checked on CPU against the live
tensors of real steps; it is a small part of the peak. CUDA kernels may keep other temporaries than CPU ones:
benchmarks/gpu_8b.py measures.

One process (per GPU) holds, at its peak:
  weights + optimizer state                                            always
  (+ the gradients, under DDP or while accumulating: they stay allocated between steps)
  + the largest of: the forward  (saved activations, one block's temporaries)
                    the backward (activations not yet used, gradients so far, one block's temporaries)
                    the optimizer step (all gradients, the step's temporaries)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..model.classifier import POOLINGS, trained_blocks
from ..model.config import LlamaConfig, parse_dtype
from ..model.counts import ParamCounts, count_parameters
from ..model.lora import LoRASettings
from .activations import (
    FP32,
    BatchShape,
    BlockSaved,
    backward_work,
    block_forward_work,
    block_saved,
    last_block_saved_bytes,
    norm_forward_work,
    norm_saved_bytes,
    outside_blocks_saved_bytes,
    trained_forward_work,
)

GiB = 2**30
OPTIMIZER_STATES = ("param", "float32")  # see train.make_optimizer
QUANTIZE = {"nf4": "NF4", "int8": "int8"}  # --quantize's choices, as the report names them
NF4_BLOCK = 64  # NF4: one scale per this many weights
SCALE_BYTES = 4  # every scale, NF4's per block and int8's per output row, is a float32


# Several GPUs: NCCL's own buffers and communicators, outside PyTorch's allocator (NVLS on an NVSwitch node such as
# an 8-GPU H100 reserves about 2.25 GiB per GPU), so max_memory_allocated() never shows them.
COLLECTIVES_RESERVE = GiB * 9 // 4


def with_margin(n: int) -> int:
    """The GPU memory to ask for `n` bytes of tensors: 5% and 0.5 GiB more for the CUDA context and fragmentation."""
    return int(n * 1.05) + GiB // 2


def planned_rows(batch_size: int, batch_tokens: int | None, seq_len: int) -> int:
    """Texts of `seq_len` tokens a micro-batch is planned as. With a budget of `batch_tokens` (`--batch-tokens`) a
    batch holds at most that many tokens, or one text longer than it: the plan takes enough whole texts of the
    longest length to hold the budget, which covers both; attention's padded copy of a packed batch is planned
    as those texts (see planned_tokens)."""
    return batch_size if batch_tokens is None else max(1, -(-batch_tokens // seq_len))


def planned_batch(batch_size: int, batch_tokens: int | None, seq_len: int) -> dict[str, int | None]:
    """PlanInputs' batch fields for a run's --batch-size or --batch-tokens, texts of up to `seq_len` tokens."""
    return {
        "batch_size": planned_rows(batch_size, batch_tokens, seq_len),
        "seq_len": seq_len,
        "tokens": planned_tokens(batch_tokens, seq_len),
    }


def planned_tokens(batch_tokens: int | None, seq_len: int) -> int | None:
    """Real tokens of a packed micro-batch under a budget of `batch_tokens`: the budget, or one text longer than it
    (budget_batches never puts a second text beside a text that fills it). None without a budget: every text is
    planned at `seq_len` tokens."""
    return None if batch_tokens is None else max(batch_tokens, seq_len)


@dataclass(frozen=True)
class PlanInputs:
    """What the memory plan is given: a training run as memory sees it (the model, the batch, what trains, the
    optimizer state, the processes and how they share the work). `batch_size` is per process (per GPU). Not
    `TrainSettings`: `--plan` builds these from the flags and a config alone, before any data or weight is read."""

    cfg: LlamaConfig
    batch_size: int  # texts (rows) per micro-batch
    seq_len: int  # the longest text's tokens
    train_last: int | None = 1  # None: everything trains
    num_classes: int = 2
    dtype: torch.dtype | None = None  # parameter dtype; None: the config's
    optimizer_state: str = "float32"  # fp32 master + moments (the runs' default); "param": moments in the param dtype
    gradient_checkpointing: bool = False
    world_size: int = 1  # DDP: a full replica per process; its gradients are kept between steps (bucket views)
    nodes: int = 1  # machines the world_size processes run on, as many on each (torchrun --nnodes)
    shard: bool = False  # FSDP2 (--shard): every parameter, gradient and moment split across the world_size processes
    shard_group: int | None = None  # hybrid sharding (--shard-group): split across this many, replicated beyond
    grad_accum: int = 1  # >1: gradients stay allocated through the next micro-batch's forward
    device_type: str = "cuda"  # "cuda": the flash attention layout; "cpu": what CPU kernels do
    lora: LoRASettings | None = None  # adapters in the trained blocks, whose own weights and norms stay frozen
    quantize: str | None = None  # "nf4" or "int8": the frozen linear weights held in 4 or 8 bits (--quantize)
    packed: bool = True  # the texts packed into one stream, as training lays them out; False: a padded batch
    tokens: int | None = None  # packed: the real tokens of the batch, if fewer than batch_size x seq_len
    pooling: str = "last"  # what the head reads (--pooling): "mean" runs the last block and final norm everywhere

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer_state must be one of {OPTIMIZER_STATES}, got {self.optimizer_state!r}")
        if self.batch_size < 1 or self.seq_len < 1:
            raise ValueError(f"batch size and sequence length must be positive, got {self.batch_size}, {self.seq_len}")
        if self.nodes < 1 or self.world_size < 1 or self.world_size % self.nodes:
            raise ValueError(
                f"world size {self.world_size} must be a positive multiple of the {self.nodes} node(s): as many "
                "processes on each node"
            )
        if self.quantize is not None and self.quantize not in QUANTIZE:
            raise ValueError(f"quantize must be one of {tuple(QUANTIZE)} or None, got {self.quantize!r}")
        if self.quantize is not None and self.shard:
            raise ValueError(
                "--quantize holds a whole quantized base on each GPU and --shard splits full-precision weights "
                "across GPUs: plan one or the other"
            )
        if self.quantize is not None and self.train_last is None and self.lora is None:
            raise ValueError("--quantize needs frozen weights: every block trains (--train-last all); add --lora RANK")
        if self.tokens is not None and not (
            self.packed and self.batch_size + self.seq_len - 1 <= self.tokens <= self.batch_size * self.seq_len
        ):
            raise ValueError(
                f"{self.tokens} tokens cannot be a packed batch of {self.batch_size} texts, the longest {self.seq_len}"
            )

    @property
    def per_node(self) -> int:
        """Processes (GPUs) on each node."""
        return self.world_size // self.nodes

    @property
    def param_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype) if self.dtype is not None else self.cfg.dtype

    @property
    def trained_blocks(self) -> int:
        return len(trained_blocks(self.cfg.n_layers, self.train_last))

    @property
    def full_blocks(self) -> int:
        """Trained blocks that run at every position: all but the last one under `--pooling last` (it runs at the
        pooled tokens only), all of them under `--pooling mean`."""
        k = self.trained_blocks
        return k if self.pooling == "mean" else max(k - 1, 0)

    @property
    def checkpointed_blocks(self) -> int:
        """Full blocks recomputed in backward under --gradient-checkpointing: all of them, but under `--pooling mean`
        not the top one, whose backward comes first (Llama.run_blocks)."""
        if not self.gradient_checkpointing:
            return 0
        return max(self.full_blocks - (self.pooling == "mean"), 0)

    @property
    def layout(self) -> BatchShape:
        """The micro-batch's shape: what the activations grow with (activations.BatchShape)."""
        if not self.packed:
            return BatchShape.padded(self.batch_size, self.seq_len)
        return BatchShape(self.batch_size, self.seq_len, self.tokens or self.batch_size * self.seq_len, packed=True)


def quantized_bytes(scheme: str, shapes: tuple[tuple[int, int], ...]) -> int:
    """Bytes that `scheme` holds for linear weights of these (out, in) shapes: NF4 packs two 4-bit codes a byte and
    keeps a float32 scale per block of NF4_BLOCK weights (a tensor's last block may be short); int8 holds a byte a
    weight and a float32 scale per output row."""
    if scheme == "nf4":
        if rows := [i for _, i in shapes if i % NF4_BLOCK]:
            raise ValueError(
                f"--quantize nf4 needs rows of a multiple of {NF4_BLOCK} weights; this model has {rows[0]}"
            )
        return sum(-(-o * i // 2) + SCALE_BYTES * -(-o * i // NF4_BLOCK) for o, i in shapes)
    if scheme == "int8":
        return sum(o * i + SCALE_BYTES * o for o, i in shapes)
    raise ValueError(f"unknown quantization {scheme!r}; choose one of {tuple(QUANTIZE)}")


def dequantizing_bytes(scheme: str, itemsize: int) -> int:
    """Bytes a weight at the peak of dequantizing one linear for its matmul (model/quantize.py), the result in the
    compute dtype (`itemsize`) included. NF4: the 4-bit indices as int64 (8), their float32 levels (4) and those
    times the scales (4) are all alive when the product is cast (a float32 product is the result: no cast).
    int8: the float32 values and their product with the scales (4 + 4), then the product and the result.
    Measured live on the CPU: 18.06, 16.06 (NF4, bfloat16 and float32) and 8.0 (int8) bytes a weight."""
    if scheme == "nf4":
        return 16 + (itemsize if itemsize != FP32 else 0)
    return max(8, FP32 + (itemsize if itemsize != FP32 else 0))


@dataclass(frozen=True)
class Quantized:
    """What --quantize changes in a plan, in bytes (all 0 without it)."""

    held: int = 0  # the frozen linear weights as stored: codes and scales
    full_precision: int = 0  # elements of everything else, held in the parameter dtype
    transient: int = 0  # the largest frozen linear of the blocks being dequantized, its temporaries included


def quantized_parts(r: PlanInputs, counts: ParamCounts) -> Quantized:
    """The weights as --quantize holds them (the frozen linears, counts.frozen_linears, quantized) and the
    dequantizing's transient. Nothing dequantized is saved for backward: a quantized layer keeps its codes and
    dequantizes again in backward (model/quantize.py, FrozenQuantizedLinear)."""
    if r.quantize is None:
        return Quantized(full_precision=counts.total)
    s = r.param_dtype.itemsize
    quantized = sum(o * i for o, i in counts.frozen_linears)
    transient = dequantizing_bytes(r.quantize, s) * counts.largest_frozen_block_linear
    held = quantized_bytes(r.quantize, counts.frozen_linears)
    return Quantized(held, counts.total - quantized, transient)


def gathered_bytes(r: PlanInputs, counts: ParamCounts) -> tuple[int, int]:
    """Sharded (FSDP2): whole parameters held beside the shards in forward and in backward (sharding.shard_model).

    A group (a block, an untied embedding, the root) is gathered into one buffer and then copied out into its
    parameters: twice its size for a moment. Forward: the block being computed, and the next one, prefetched, in
    that moment (the embedding first, when it is a group of its own). Backward: the same, then the block's whole
    gradient beside both, in its dtype and in float32 for the reduce-scatter (the simulation says the block is
    still there; benchmarks/simulate_scale.py). A tied
    embedding lives in the root group with the head: gathered from the classifier's forward to the end of
    backward, its gradient reduced last, after the root's parameters are freed."""
    if not r.shard:
        return 0, 0
    s, cfg = r.param_dtype.itemsize, r.cfg
    block, grad = s * counts.block, s * counts.block_trained
    # gathering the next block beside this one; or both, and this block's gradient in its dtype and in float32
    blocks = max(3 * block, 2 * block + grad + FP32 * counts.block_trained)
    emb_trained = counts.embedding if r.train_last is None else 0
    if cfg.tie_embeddings:
        root = s * (counts.embedding + counts.head + cfg.dim)
        return max(2 * root, root + 3 * block), max(root + blocks, (s + FP32) * emb_trained)
    emb = s * counts.embedding
    return max(2 * emb, emb + 2 * block, 3 * block), max(blocks, emb + s * emb_trained, (s + FP32) * emb_trained)


# --- the plan ---------------------------------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    bytes: int
    note: str = ""


@dataclass
class MemoryPlan:
    """Bytes per process: the parts, the peak and the phase it falls in."""

    inputs: PlanInputs
    counts: ParamCounts
    weights: int
    gradients: int
    optimizer_state: int
    activations: int  # everything saved for backward at the end of the forward
    block_activations: int  # a full block's saved set (what checkpointing recomputes one block at a time)
    last_block_activations: int  # the classifier's last block, which runs at the pooled tokens
    forward_work: int
    backward_work: int
    step_work: int
    frozen_forward: int  # the transient peak of a frozen block's forward
    phases: dict[str, int] = field(default_factory=dict)
    gathered: int = 0  # sharded: whole parameters (and gradients) held beside the shards at once, at most
    quantized: int = 0  # --quantize: the bytes of the frozen linear weights as quantized (within `weights`)
    dequantized: int = 0  # --quantize: one frozen linear being dequantized (its temporaries too), while it runs

    @property
    def persistent(self) -> int:
        return self.weights + self.optimizer_state

    @property
    def peak(self) -> int:
        return self.persistent + max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def collectives(self) -> int:
        """NCCL's memory when several GPUs train together (none on CPU, or alone)."""
        return COLLECTIVES_RESERVE if self.inputs.world_size > 1 and self.inputs.device_type == "cuda" else 0

    def required(self) -> int:
        """The GPU memory to ask for: the peak plus room for the CUDA context, allocator fragmentation and NCCL."""
        return with_margin(self.peak) + self.collectives

    def fits(self, gpu_bytes: int) -> bool:
        return self.required() <= gpu_bytes

    def as_dict(self) -> dict:
        r = self.inputs
        return {
            "model_params": self.counts.backbone,
            "trainable_params": self.counts.trainable,
            "batch_size": r.batch_size,
            "seq_len": r.seq_len,
            "tokens": r.layout.tokens,
            "packed": r.packed,
            "train_last": r.train_last,
            "pooling": r.pooling,
            "dtype": str(r.param_dtype).removeprefix("torch."),
            "optimizer_state": r.optimizer_state,
            "gradient_checkpointing": r.gradient_checkpointing,
            "world_size": r.world_size,
            "nodes": r.nodes,
            "shard": r.shard,
            "quantize": r.quantize,
            "quantized_weights": self.quantized,
            **{k: getattr(self, k) for k in ("weights", "gradients", "optimizer_state")},
            **{k: getattr(self, k) for k in ("activations", "forward_work", "backward_work", "step_work")},
            "frozen_forward": self.frozen_forward,
            "phases": dict(self.phases),
            "peak": self.peak,
            "required": self.required(),
        }


def optimizer_bytes(r: PlanInputs, counts) -> tuple[int, int]:
    """AdamW's state, and its temporaries during a step. torch's AdamW keeps exp_avg and exp_avg_sq in the
    parameter dtype; "float32" keeps both in float32 next to a float32 master copy of each low-precision trained
    parameter (train.make_optimizer)."""
    s, p = r.param_dtype.itemsize, counts.trainable
    master = r.optimizer_state == "float32" and s < FP32
    state_size = FP32 if r.optimizer_state == "float32" else s
    state = 2 * state_size * p + (FP32 * p if master else 0)
    # fused AdamW (GPUs and CPUs) needs no temporaries; multi-tensor (foreach) AdamW, for sharded parameters
    # (strategy.optimizer_kernels), makes sqrt(v) of a whole parameter group at once: this process's share of the
    # second moments (counted whole: the norm gains' group, stepped apart, is a few thousandths of it).
    temporaries = state_size * p if r.shard else 0
    if not master:
        return state, temporaries
    # float32 gradients replace the low-precision ones, one tensor at a time, before AdamW steps
    if not r.shard and r.world_size > 1:  # DDP: the low-precision ones stay (bucket views), through AdamW's step
        return state, FP32 * p + temporaries
    return state, (FP32 - s) * p + max(low_precision_kept(r, counts), temporaries)


def low_precision_kept(r: PlanInputs, counts) -> int:
    """Of the low-precision gradients that MasterWeightAdamW.step drops as it makes their float32 copies (optim.py),
    the bytes still held when the last copy is made (beside all the float32 ones; AdamW's own temporaries come
    after, when these are gone). Under DDP none is freed: they are views of its buckets (see optimizer_bytes).

    Sharded (FSDP2), a group's gradients (a block's, the
    root's) are views of one buffer, freed when the last of them is dropped; the copies are made weight matrices
    first, then norm gains (the optimizer's two parameter groups), so a group with a trained norm gain (a trained
    block, not its LoRA adapters; the root: final norm, head, a tied embedding) keeps all its gradients until the
    end. Alone, each is freed as its copy appears."""
    s, cfg = r.param_dtype.itemsize, r.cfg
    if not r.shard:
        return s * counts.trainable if r.world_size > 1 else 0
    n = r.shard_group or r.world_size
    root = counts.head + -(-cfg.dim // n)
    if cfg.tie_embeddings and r.train_last is None:
        root += -(-cfg.vocab_size // n) * cfg.dim
    blocks = r.trained_blocks * counts.block_trained if r.lora is None else 0
    return s * (blocks + root)


def backward_peak(
    r: PlanInputs,
    cfg: LlamaConfig,
    counts,
    activations: int,
    held: int,
    saved: tuple[int, int, int, BlockSaved, BlockSaved],
) -> int:
    """The most memory backward holds at once, beside weights and optimizer state.

    Backward goes block by block from the top (the head's and final norm's gradients come first, the embedding's
    last). A block starts with all its saved tensors alive (a checkpointed one recomputes them next to its kept
    input), the gradients of the blocks above and its first weight gradient (down_proj's). Its feed-forward half
    done, the feed-forward norm's backward runs with the attention half's saved tensors still there and all the
    feed-forward's weight gradients made (the larger moment when those gradients outweigh the feed-forward's saved
    tensors: few tokens, full weights). It ends in its attention norm with only that norm's saved tensors left and
    all its weight gradients. Blocks below it still hold what they saved. `saved` is (last block, first kept, other
    kept, first full, other full) in bytes, the full ones by half. The last block's largest temporaries come in its
    attention's backward (keys and values span every position, the rest runs at the pooled rows only), after the
    gradients of its feed-forward and o_proj: those are there. (Under `--pooling mean` every trained block is a full
    one: there is no such last block.)
    """
    last, kept_first, kept_per_block, first, rest = saved
    s, b = r.param_dtype.itemsize, r.layout
    full = r.full_blocks
    grads, block_grads, lora = s * counts.trainable, s * counts.block_trained, r.lora is not None
    work = backward_work(cfg, b, s, r.device_type, r.lora is not None)
    # Per block: its bytes kept until its turn, then its moments: (alive in it, its gradients made, temporaries).
    sweep: list[tuple[int, list[tuple[int, int, int]]]] = []
    if r.trained_blocks > full:  # the last block, at the pooled tokens
        input_grad = full > 0 or r.train_last is None
        end_work = work["end"] if input_grad else work["end, input frozen"]
        at_end = norm_saved_bytes(cfg, b, s, input_grad, lora)
        above_attention = block_grads - s * counts.below_attention_trained
        sweep.append((last, [(last, above_attention, work["last start"]), (at_end, block_grads, end_work)]))
    for i in range(full):
        bottom = i == full - 1
        kept, parts = (kept_first, first) if bottom else (kept_per_block, rest)
        checkpointed = i >= full - r.checkpointed_blocks  # i counts from the top; it may be left whole
        kept = kept if checkpointed else parts.total
        recomputed_beside = kept if checkpointed else 0  # a checkpointed block's input stays through its backward
        input_grad = r.train_last is None or not bottom
        at_end = norm_saved_bytes(cfg, b, s, input_grad, lora)
        moments = [
            (parts.total, s * counts.down_trained, work["start"]),
            (parts.attention + parts.ffn_norm, s * counts.ffn_trained, work["end"]),
            (at_end, block_grads, work["end"] if input_grad else work["end, input frozen"]),
        ]
        sweep.append((kept, [(at + recomputed_beside, made, temp) for at, made, temp in moments]))
    alive, done = activations, s * (counts.head + cfg.dim)  # head and final norm
    # Under --pooling mean the final norm's backward runs at every token first, its arithmetic in float32.
    final_norm = (work["end"] if r.trained_blocks else work["end, input frozen"]) if r.pooling == "mean" else 0
    peak = alive + max(held, done) + final_norm
    for kept, moments in sweep:
        alive -= kept
        peak = max(peak, *(alive + at + max(held, done + made) + temp for at, made, temp in moments))
        done += block_grads
    return max(peak, alive + grads)  # the embedding's gradient, when everything trains


def held_gradients(r: PlanInputs, whole: int, mine: int) -> int:
    """Gradients allocated through the forward: when accumulating (the earlier micro-batches' are there), and under
    DDP, where they are views of its all-reduce buckets, zeroed between steps but never freed (distributed.wrap).
    Sharded, the micro-batches before a step's last keep theirs whole (unsharded) until it: `whole`, not `mine`."""
    if r.shard:
        return whole if r.grad_accum > 1 else 0
    return mine if r.grad_accum > 1 or r.world_size > 1 else 0


def full_blocks_saved(r: PlanInputs, cfg: LlamaConfig) -> tuple[BlockSaved, BlockSaved]:
    """What the lowest full trained block and each one above it save (activations.block_saved)."""
    s, b = r.param_dtype.itemsize, r.layout
    first = block_saved(cfg, b, s, r.train_last is None, r.device_type, r.lora)
    rest = block_saved(cfg, b, s, True, r.device_type, r.lora)
    return first, rest


def saved_activations(r: PlanInputs, cfg: LlamaConfig) -> tuple[int, tuple[int, int, int, BlockSaved, BlockSaved]]:
    """Bytes kept from forward to backward, in all, and the parts that backward frees block by block: the classifier's
    last block at the pooled rows, the lowest full block, each full one above it (their inputs only, when
    checkpointed), and what those two save as their backward has it (`backward_peak`'s `saved`).

    The trained blocks are k - 1 full ones and the classifier's last block, run at the pooled rows; under --pooling
    mean, k full ones."""
    s, b, k, full = r.param_dtype.itemsize, r.layout, r.trained_blocks, r.full_blocks
    first, rest = full_blocks_saved(r, cfg)
    kept_per_block = s * b.tokens * cfg.dim if r.gradient_checkpointing else rest.total  # the block's input
    kept_first = s * b.tokens * cfg.dim if r.gradient_checkpointing else first.total
    last_grad = full > 0 or r.train_last is None
    last = last_block_saved_bytes(cfg, b, s, last_grad, r.device_type, r.lora) if k > full else 0
    outside = outside_blocks_saved_bytes(cfg, b, s, k, r.num_classes, r.train_last is None, r.pooling)
    kept = [kept_first] + [kept_per_block] * (full - 1) if full else []  # each full block's, from the bottom
    if r.checkpointed_blocks < full and r.gradient_checkpointing:  # the top one, not recomputed, is kept whole
        kept[-1] = first.total if full == 1 else rest.total
    return sum(outside.values()) + last + sum(kept), (last, kept_first, kept_per_block, first, rest)


def plan_memory(r: PlanInputs) -> MemoryPlan:
    """Bytes one process needs for a run of these inputs, part by part, and its peak."""
    if r.lora is not None and r.train_last is None:  # adapters in every block; the embedding stays frozen
        r = dataclasses.replace(r, train_last=r.cfg.n_layers)
    cfg = dataclasses.replace(r.cfg, dtype=r.param_dtype)
    s = r.param_dtype.itemsize
    whole = count_parameters(cfg, r.train_last, r.num_classes, r.lora)
    shards = (r.shard_group or r.world_size) if r.shard else 1
    counts = count_parameters(cfg, r.train_last, r.num_classes, r.lora, shards) if shards > 1 else whole  # mine
    k = r.trained_blocks
    b = r.layout

    optimizer_state, step_work = optimizer_bytes(r, counts)
    full = r.full_blocks
    qz = quantized_parts(r, counts)
    activations, parts = saved_activations(r, cfg)
    last, first, rest = parts[0], parts[3], parts[4]
    block_full = rest.total if full > 1 or r.train_last is None else first.total

    grads = s * counts.trainable
    frozen_work = block_forward_work(cfg, b, s)
    # A checkpointed block's forward runs like a frozen one: its internals are temporaries.
    fwd_work = frozen_work if r.gradient_checkpointing else trained_forward_work(cfg, b)
    if r.pooling == "mean":  # the final norm at every token, after the blocks: its float32 arithmetic
        fwd_work = max(fwd_work, norm_forward_work(cfg, b, s))
    work = backward_work(cfg, b, s, r.device_type, r.lora is not None)
    held = held_gradients(r, s * whole.trainable, grads)
    gathered_forward, gathered_backward = gathered_bytes(r, whole)
    backward = backward_peak(r, cfg, counts, activations, held, parts)
    # --quantize: each frozen linear is dequantized as it runs, one at a time; under LoRA, whose blocks compute over
    # quantized weights, again in backward, for its input's gradient (and in a checkpointed block's rerun).
    recomputed = qz.transient if r.lora is not None else 0
    phases = {
        "frozen forward": frozen_work + held + gathered_forward + qz.transient,
        "forward": activations + fwd_work + held + gathered_forward + qz.transient,
        "backward": backward + gathered_backward + recomputed,
        "optimizer step": grads + step_work,
    }
    if k == cfg.n_layers:
        del phases["frozen forward"]  # nothing is frozen
    return MemoryPlan(
        inputs=r,
        counts=whole,
        weights=s * qz.full_precision + qz.held + counts.buffer_bytes,
        gradients=grads,
        optimizer_state=optimizer_state,
        activations=activations,
        block_activations=block_full if full else 0,
        last_block_activations=last,
        forward_work=fwd_work,
        backward_work=max(work["start"] if full else work["last start"], work["end"]),
        step_work=step_work,
        frozen_forward=frozen_work if k < cfg.n_layers else 0,
        phases=phases,
        gathered=max(gathered_forward, gathered_backward),
        quantized=qz.held,
        dequantized=qz.transient,
    )
