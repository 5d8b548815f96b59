"""How the processes share a run, decided once at start-up: the object the rest of the package asks.

The loop, evaluation, saving, the best weights' reload and the frozen-prefix cache differ between one process, DDP
and FSDP2. Instead of each asking "sharded? how many processes? am I rank 0?", the command
chooses a strategy once (`choose_strategy`) and passes it where those decisions are made:

- `Replicated`: 1..N processes, each holding a whole replica of the model (DistributedDataParallel when N > 1).
  With one process every collective is a no-op, so one process, a notebook and DDP take the same path.
- `Sharded`: N > 1 processes under `--shard`, FSDP2 (sharding.py): each holds 1/N of every parameter, gradient
  and optimizer moment, over the device mesh the strategy holds.

What both share (logging on rank 0, rank 0 deciding for everyone, sums and exchanges across processes) is in
`Strategy`; what differs is a method each of the two defines. It is about processes only: what a resume point is
and who reads and writes it is training/resume_points.py's, which uses the collectives here. Between processes
travel tensors and JSON, never a pickle. Lightning Fabric's strategies and torchtitan's
ParallelDims are the same idea at a larger scale; this is the part this project needs, and no more.
"""

from __future__ import annotations

import contextlib
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

from ..checkpoints.weights import copy_named_file, save_weights
from ..model.classifier import LlamaClassifier, full_precision_blocks
from ..model.lora import LoRASettings
from ..sources.resolve import config_of, load_model
from . import distributed, sharding
from .distributed import Processes, teardown, unwrap

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# What the rest of the package imports from the parallel folder: this module is its interface.
__all__ = [
    "Processes",
    "Replicated",
    "Sharded",
    "Strategy",
    "Vote",
    "choose_strategy",
    "optimizer_kernels",
    "teardown",
    "unwrap",
]

T = TypeVar("T")


def choose_strategy(device: str | None = None, shard: bool = False, shard_group: int | None = None) -> Strategy:
    """Join torchrun's process group when it started this process, choose the process's device (`device`: the
    --device flag), and decide how the processes share the model: `Sharded` for `shard` with several processes,
    with its mesh (`shard_group`: hybrid sharding, see sharding.make_mesh); `Replicated` otherwise. A `--shard` run
    of one process is a plain one: alone there is nothing to share out."""
    processes, dev = distributed.setup(device)
    if shard and processes.several:
        return Sharded(processes, dev, sharding.make_mesh(processes, dev, shard_group))
    return Replicated(processes, dev)


def optimizer_kernels(params: list[torch.Tensor]) -> dict[str, bool | None]:
    """AdamW's `fused` and `foreach` arguments for these parameters. The fused kernel on GPUs and CPUs: no
    temporaries (foreach briefly copies the optimizer state), and several times faster than a tensor at a time
    (benchmarks/RESULTS.md). Sharded parameters (DTensors) take the multi-tensor (foreach) kernel: the fused one
    gathered them whole in our simulation (benchmarks/simulate_scale.py, RESULTS.md), while DTensor runs each
    foreach op on the local shards (torch >= 2.4, all of them on one mesh, as sharding.shard_model puts them), a
    few launches per group instead of a few per tensor; its temporaries, one copy of this process's share of the
    second moments (sqrt(v)), are in the plan (planning/memory.optimizer_bytes). Explicit, not None: torch
    defaults DTensors to foreach on GPUs only, and to one tensor at a time on a CPU.

    Read from the tensors rather than asked of a strategy: the optimizer is built from whatever parameters it is
    given (benchmarks build it on sharded models of their own), and it is the tensors' kind that the kernel cares
    about."""
    sharded = any(sharding.is_dtensor(p) for p in params)
    fused = (bool(params) and all(p.device.type in ("cuda", "cpu") for p in params) and not sharded) or None
    return {"fused": fused, "foreach": True if sharded else None}


@dataclass(frozen=True)
class Vote:
    """How many of the processes (`of`) raised a flag (`count`): what a decision that all must take alike reads."""

    count: int
    of: int

    @property
    def everyone(self) -> bool:
        return self.count == self.of

    @property
    def nobody(self) -> bool:
        return self.count == 0


@dataclass(frozen=True)
class Strategy(ABC):
    """This process's place among the processes of a run, its device, and every decision that depends on them."""

    processes: Processes = field(default_factory=Processes)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    # --- what every process shares, whatever holds the model ---------------------------------------------------

    @property
    def is_main(self) -> bool:
        """Rank 0: it alone prints, draws progress bars, writes the run's files and decides for everyone."""
        return self.processes.is_main

    def log(self, *args, **kwargs) -> None:
        """`print` on rank 0 only: N processes would print every line N times."""
        if self.is_main:
            print(*args, **kwargs)

    def quiet_elsewhere(self, *categories: type[Warning]) -> None:
        """Ignore these warnings except on rank 0: every process reads the same data, and would repeat rank 0's
        warnings about it word for word."""
        if not self.is_main:
            for category in categories:
                warnings.simplefilter("ignore", category)

    def on_main(self, fn: Callable[[], T]) -> T:
        """`fn()` run by rank 0 alone; every process returns its result or raises its error. For what must be
        decided once (a path, a dtype when free memory differs, a run id) and for files rank 0 alone reads or
        writes: a process that failed alone would leave the others waiting in the next collective for hours.
        The result travels as JSON (a path as a string, a dtype by its name: the caller converts), the error as
        its class and message (distributed.raise_sent); alone too, so that one process returns what several do."""
        if not self.processes.several:
            return distributed.as_json(fn())
        sent, error = None, None
        if self.is_main:
            try:
                sent = {"result": distributed.as_json(fn())}
            except Exception as e:  # handed to every process, raised by each
                sent, error = {"error": distributed.error_json(e)}, e
        sent = distributed.broadcast_json(sent)
        if error is not None:
            raise error  # rank 0's own, with its traceback
        return distributed.raise_sent(sent)

    def on_each_node(self, make: Callable[[], T]) -> T:
        """`make()` (say, fetching the model) on rank 0, then on the first process of every other node, which may
        not share rank 0's disk; every process gets its node's answer (distributed.on_each_node)."""
        return distributed.on_each_node(make, self.processes)

    def barrier(self) -> None:
        """Every process arrives before any goes on (say, all have looked at a directory before rank 0 changes it)."""
        if self.processes.several:
            distributed.barrier()

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over the processes (the values themselves alone)."""
        return distributed.all_sum(values) if self.processes.several else values

    def host_sum(self, values: list[int]) -> list[int]:
        """Element-wise sums of a few integers over the processes, on the host (a vote: how many processes found
        a file, or failed); alone, `values` themselves."""
        return distributed.host_sum(values) if self.processes.several else list(values)

    def vote(self, *flags: bool) -> list[Vote]:
        """For each flag, how many processes raised it (one sum on the host): so that every process, having looked
        at what it alone sees (a file on its disk), takes the same decision. Alone: each flag's own count, of 1."""
        counts = self.host_sum([int(bool(f)) for f in flags])
        return [Vote(n, self.processes.world_size) for n in counts]

    def tensors_from_main(self, tensors: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Rank 0's named CPU tensors (None elsewhere) on every process, each tensor's bytes broadcast over the host
        group (distributed.broadcast_tensors)."""
        return distributed.broadcast_tensors(tensors) if self.processes.several else dict(tensors or {})

    def stop_agreed(self, asked: bool) -> bool:
        """Whether any process was asked to stop (Ctrl-C, SIGTERM: `asked` is this one's), on every process alike:
        one vote at a step's end, so that all stop at the same step and save together (a process stopping alone
        would save through collectives the others never reach). The vote is a sum of one integer on the host
        group (gloo, on the CPU): it makes no process wait for its GPU."""
        return distributed.host_sum([int(asked)])[0] > 0 if self.processes.several else asked

    def least_room(self, room: int) -> int:
        """The bytes each process may spend, alike on every process: a decision all must take alike (say, whether
        to cache), since a process that decides otherwise would wait in a collective the others skip. The
        tightest process's `room` decides; processes on a CPU share the host's memory, so each gets its share."""
        if self.device.type == "cpu":
            room //= self.processes.world_size
        return distributed.smallest(room) if self.processes.several else room

    def exchange_rows(
        self, indices: list[int], rows: list[torch.Tensor], width: int, dtype: torch.dtype
    ) -> dict[int, torch.Tensor]:
        """Every process's `rows` ([length, width] tensors) by their `indices`, on every process (one collective:
        distributed.all_gather_rows); alone, its own."""
        if not self.processes.several:
            return dict(zip(indices, rows, strict=True))
        return distributed.all_gather_rows(indices, rows, width, dtype, self.device)

    def held_bytes(self, module: nn.Module) -> int:
        """Bytes of `module`'s parameters and buffers this process holds (its rows of a sharded one)."""
        tensors = [*module.parameters(), *module.buffers()]
        return sum(sharding.local(t).numel() * t.element_size() for t in tensors)

    def per_process(self, words: str) -> str:
        """`words` when several processes run, nothing alone: for a log line whose figure each process holds."""
        return words if self.processes.several else ""

    # --- what depends on how the model is held ------------------------------------------------------------------

    @abstractmethod
    def describe(self) -> str:
        """What the 'training N parameters on DEVICE' line adds about the processes."""

    @property
    @abstractmethod
    def refuses_unfit_replica(self) -> bool:
        """Whether a run whose replica cannot fit must be refused before it loads (planning.report's
        `refuse_unfit_replica`, which the command calls: planning is not the parallel folder's to import)."""

    @abstractmethod
    def build_classifier(
        self,
        ref: str,
        dtype: torch.dtype,
        num_classes: int,
        train_last: int | None,
        lora: LoRASettings | None,
        quantize: str | None = None,
    ) -> LlamaClassifier:
        """The classifier on this process's device: the backbone loaded from `ref` (its frozen linears quantized
        as they load with `quantize`), and a fresh head (and LoRA adapters), drawn as one process draws them."""

    @abstractmethod
    def wrap(self, clf: LlamaClassifier) -> nn.Module:
        """The model the loop trains."""

    @abstractmethod
    def gradient_sync(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """A backward's context: gradients combined across processes after it (`sync`, a step's last
        micro-batch), or only accumulated locally (the micro-batches before)."""

    @abstractmethod
    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Gradients cleared after a step."""

    @abstractmethod
    def full_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The gradient norm `clip_grad_norm_` returned, as the norm of the whole model's gradients."""

    @abstractmethod
    def forwards_only(self, model: nn.Module, inference: bool = True) -> contextlib.AbstractContextManager:
        """The context of a pass of forwards without backward (evaluation; with `inference` False, outputs that
        training reads later: the frozen-prefix cache, which inference tensors could not be)."""

    @abstractmethod
    def batches_to_match(self, mine: int) -> int:
        """How many batches beyond its own `mine` this process runs, so that every process runs as many forwards
        (it drops their results)."""

    @abstractmethod
    def save_trained(self, named: dict[str, torch.Tensor], path: Path, metadata: dict | None = None) -> None:
        """`named` as one safetensors file written by rank 0. Every process calls it."""

    @abstractmethod
    def load_trained(self, model: nn.Module, named: dict[str, torch.Tensor], path: Path) -> None:
        """`named` (parameters of `model`) set to rank 0's file `path`, which the other processes need not see
        (several machines, no shared disk): rank 0 reads, every process receives. Every process calls it."""

    @property
    @abstractmethod
    def state_per_process(self) -> bool:
        """Whether each process holds only its own part of the trained state (its rows), and so saves and reads
        its own part of a resume point (training/resume_points.py); False: every process holds all of it."""

    @abstractmethod
    def as_resumed(self, record: dict, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """A read resume point's tensors (resume.read_point) made like the parameters they are restored into."""


@dataclass(frozen=True)
class Replicated(Strategy):
    """Every process holds the whole model: one process alone, or DDP's replicas. `Replicated()` is one process on
    the CPU; `Replicated(device=torch.device("cuda", 0))` one on a GPU."""

    def describe(self) -> str:
        return ""  # DDP's processes say nothing: the same training, faster

    @property
    def refuses_unfit_replica(self) -> bool:
        """Several processes on GPUs: the refusal names --shard, the way out that several processes have."""
        return self.processes.several and self.device.type == "cuda"

    def build_classifier(
        self,
        ref: str,
        dtype: torch.dtype,
        num_classes: int,
        train_last: int | None,
        lora: LoRASettings | None,
        quantize: str | None = None,
    ) -> LlamaClassifier:
        """The backbone streamed onto the device (sources.load_model), the head put on. With `quantize`, the
        blocks that train whole stay in full precision; with LoRA every block's base weights are quantized."""
        keep = full_precision_blocks(config_of(ref).n_layers, train_last, lora) if quantize else 0
        backbone = load_model(ref, self.device, dtype, self.is_main, quantize=quantize, keep_last=keep)
        return LlamaClassifier(backbone, num_classes=num_classes, train_last=train_last, lora=lora)

    def wrap(self, clf: LlamaClassifier) -> nn.Module:
        """DistributedDataParallel with several processes (distributed.wrap); the classifier itself alone."""
        return distributed.wrap(clf, self.processes, self.device)

    def gradient_sync(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """DDP: `no_sync` before a step's last micro-batch. One process: nothing to combine."""
        if sync or not self.processes.several:
            return contextlib.nullcontext()
        return model.no_sync()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Freed gradients lower the next forward's peak; DDP's are views of its buckets: zeroed instead, or the
        next backward would allocate them again beside the buckets (distributed.wrap)."""
        optimizer.zero_grad(set_to_none=not self.processes.several)

    def full_norm(self, norm: torch.Tensor) -> torch.Tensor:
        return norm  # every process holds every gradient (DDP's already averaged)

    def forwards_only(self, model: nn.Module, inference: bool = True) -> contextlib.AbstractContextManager:
        return torch.inference_mode() if inference else torch.no_grad()

    def batches_to_match(self, mine: int) -> int:
        return 0  # a replica's forward involves no other process

    def save_trained(self, named: dict[str, torch.Tensor], path: Path, metadata: dict | None = None) -> None:
        """Rank 0 holds every tensor whole: it writes them, the others have nothing to add."""
        if self.is_main:
            save_weights({k: v.detach() for k, v in named.items()}, path, metadata)

    def load_trained(self, model: nn.Module, named: dict[str, torch.Tensor], path: Path) -> None:
        """Rank 0 reads the file into `model`'s parameters in place, one tensor at a time (every name and shape
        checked first: weights.copy_named_file), then sends `named` to the others."""
        if self.is_main:
            copy_named_file(unwrap(model), path)
        if self.processes.several:
            distributed.broadcast_parameters(list(named.values()))

    @property
    def state_per_process(self) -> bool:
        return False  # every replica holds the whole state: rank 0's is the run's

    def as_resumed(self, record: dict, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        pass  # the saved tensors are whole, as the parameters are


@dataclass(frozen=True)
class Sharded(Strategy):
    """FSDP2 over `mesh`: each process holds its rows of every parameter (sharding.py)."""

    mesh: DeviceMesh | None = None

    def describe(self) -> str:
        return f", sharded across {self.processes.world_size} processes"

    @property
    def refuses_unfit_replica(self) -> bool:
        return False  # no process holds a replica; --plan checks what each holds

    def build_classifier(
        self,
        ref: str,
        dtype: torch.dtype,
        num_classes: int,
        train_last: int | None,
        lora: LoRASettings | None,
        quantize: str | None = None,
    ) -> LlamaClassifier:
        """Built on the meta device, sharded, then each process reads only its rows (sharding.sharded_classifier).
        A quantized base is not sharded (the command refuses the two together)."""
        if quantize is not None:
            raise ValueError("--quantize with --shard is not supported: quantize, or shard, one of the two")
        return sharding.sharded_classifier(
            ref, dtype, num_classes, train_last, lora, self.mesh, self.device, progress=self.is_main
        )

    def wrap(self, clf: LlamaClassifier) -> nn.Module:
        return clf  # fully_shard wrapped it in place when it was built

    @contextlib.contextmanager
    def gradient_sync(self, model: nn.Module, sync: bool):
        """Before a step's last micro-batch the unsharded gradients are kept, and reduce-scattered after the last."""
        if sync:
            yield
            return
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)  # freed: the next forward's peak is lower without them

    def full_norm(self, norm: torch.Tensor) -> torch.Tensor:
        return sharding.full_tensor(norm)  # the norm over every process's rows, not this process's alone

    @contextlib.contextmanager
    def forwards_only(self, model: nn.Module, inference: bool = True):
        """Under no_grad, never inference_mode, whose tensors FSDP2 could not free after; then every gathered
        parameter freed (sharding.reshard: FSDP2 keeps the root's gathered after a forward, for the backward)."""
        with torch.no_grad():
            yield
        sharding.reshard(model)

    def batches_to_match(self, mine: int) -> int:
        """Each block's forward gathers the block from every process, so one that stopped early would leave the
        others waiting: every process runs as many batches as the busiest."""
        return distributed.largest(mine) - mine

    def save_trained(self, named: dict[str, torch.Tensor], path: Path, metadata: dict | None = None) -> None:
        """Gathered one tensor at a time, written by rank 0 (sharding.save_gathered)."""
        sharding.save_gathered(named, path, self.processes, metadata)

    def load_trained(self, model: nn.Module, named: dict[str, torch.Tensor], path: Path) -> None:
        """Rank 0 reads one tensor at a time and sends it; every process keeps its rows (sharding.read_from_main)."""
        sharding.read_from_main(named, path, self.processes)

    @property
    def state_per_process(self) -> bool:
        return True  # no process holds the others' rows

    def as_resumed(self, record: dict, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Each process's saved rows made DTensors like the parameters again (sharding.as_sharded)."""
        sharding.as_sharded(record, model, optimizer)
