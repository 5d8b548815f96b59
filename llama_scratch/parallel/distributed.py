"""Several processes: what torchrun sets up, DDP's wrapper, and the collectives the strategy (strategy.py) uses.

`torchrun --nproc_per_node N` starts N copies of the same command with RANK, LOCAL_RANK and WORLD_SIZE set.
Each copy trains on its own shard of every batch; DistributedDataParallel averages the gradients, so all
replicas take the same step. A single process (WORLD_SIZE unset) runs the same code with world size 1.
The rest of the package does not call these: it asks the strategy, which calls them where they apply.
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..sources.devices import DeviceError, resolve_device

COLLECTIVE_TIMEOUT = timedelta(hours=2)

# A gloo group over the same processes, made once by `setup`: small votes (stop at this step?) and host tensors (a
# resume point rank 0 read) go through it on the CPU. The default group is nccl's on GPUs, whose collectives take
# device tensors: a vote there would make the host wait for the GPU every step.
_host_group: dist.ProcessGroup | None = None


@dataclass(frozen=True)
class Processes:
    """Which of how many processes this one is: over all machines (`rank` of `world_size`), and on its own machine
    (`local_rank`, which picks its GPU). The default is a process alone."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @classmethod
    def from_environment(cls) -> Processes:
        """What torchrun told this process (RANK, LOCAL_RANK, WORLD_SIZE); a process alone when it did not start us."""
        return cls(
            rank=int(os.environ.get("RANK", 0)),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
        )

    @property
    def several(self) -> bool:
        """More than one process: collectives have someone to talk to."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 alone prints, draws progress bars and writes files."""
        return self.rank == 0


def setup(device: str | None = None) -> tuple[Processes, torch.device]:
    """Join the process group when started by torchrun, and choose this process's device.

    GPUs: one per process (see `process_device`) and the nccl backend. CPU: the gloo backend.
    """
    processes = Processes.from_environment()
    dev = process_device(device, processes, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if processes.several and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        # Other ranks wait while rank 0 alone downloads a checkpoint or writes a resume point (all of an 8B model's
        # optimizer state is tens of GB): allow that far longer than torch's default of 10 minutes.
        dist.init_process_group(backend, device_id=dev if dev.type == "cuda" else None, timeout=COLLECTIVE_TIMEOUT)
    global _host_group
    if processes.several and _host_group is None:  # every process makes it, at the same point (new_group's rule)
        _host_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    return processes, dev


def process_device(requested: str | None, processes: Processes, gpus: int) -> torch.device:
    """This process's device. Alone: what was asked (`auto`: a GPU if any). Under torchrun each process takes one
    of the GPUs it sees: local rank modulo their count, so that a launcher which shows each process only its own
    GPU (Slurm's --gpus-per-task: CUDA_VISIBLE_DEVICES of one) gives cuda:0, not an invalid cuda:LOCAL_RANK.
    Naming one GPU (`cuda:N`) under torchrun is refused: every process would take the same one."""
    if not processes.several:
        dev = resolve_device(requested)
        return torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" and dev.index is None else dev
    if requested not in (None, "auto", "cpu", "cuda"):
        raise DeviceError(
            f"--device {requested} under torchrun: each process takes the GPU of its local rank; pass --device cuda "
            "(or auto), and choose the GPUs with CUDA_VISIBLE_DEVICES"
        )
    if requested == "cpu" or gpus == 0:
        if requested == "cuda":
            raise DeviceError("--device cuda: no CUDA GPU is visible; use --device cpu")
        return torch.device("cpu")
    return torch.device("cuda", processes.local_rank % gpus)


def teardown() -> None:
    """Leave the process group (no barrier: after an error the other ranks may never arrive)."""
    global _host_group
    if dist.is_initialized():
        dist.destroy_process_group()  # every group, the host group too: a later `setup` makes a new one
    _host_group = None


def wrap(model: nn.Module, processes: Processes, device: torch.device) -> nn.Module:
    """DistributedDataParallel when there are several processes; the model itself otherwise.

    DDP all-reduces gradients in flat buckets. `gradient_as_bucket_view` makes each parameter's `.grad` a view into
    its bucket, so the gradients exist once, not twice (for all of Llama-3-8B in bfloat16 that is 15 GiB per GPU).
    The views survive only if the gradients are zeroed rather than deleted between steps (`Replicated.zero_grad`).
    """
    if not processes.several:
        return model
    # Gradients that exist when DDP is built become views of its buckets at once. Left to the first backward, the
    # first step's gradients (all of them, under --grad-accum, where that backward skips the all-reduce) are plain
    # tensors beside the already-allocated buckets: twice the gradient memory until the first synced step.
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    device_ids = [device.index] if device.type == "cuda" else None
    # The only buffers are the rotary tables, computed identically everywhere: nothing to broadcast each step
    # (newer torch names the switch forward_sync_buffers, older versions broadcast_buffers).
    accepted = inspect.signature(DistributedDataParallel).parameters
    no_buffer_sync = {"forward_sync_buffers" if "forward_sync_buffers" in accepted else "broadcast_buffers": False}
    ddp = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True, **no_buffer_sync)
    if reduces_in_float32(model):
        ddp.register_comm_hook(state=None, hook=float32_all_reduce)
    return ddp


def reduces_in_float32(model: nn.Module) -> bool:
    """Whether `wrap` all-reduces this model's gradients through `float32_all_reduce`: when any trained parameter
    is of lower precision (a float32 model's buckets are float32 already, and DDP's own all-reduce serves them)."""
    return any(p.requires_grad and p.dtype != torch.float32 for p in model.parameters())


def float32_all_reduce(state, bucket):
    """DDP's communication hook: average a bucket of gradients over the processes in float32, not in its dtype.

    DDP's default divides a bfloat16 bucket by the number of processes and sums it in bfloat16, rounding to 8 bits
    after every addition of the ring (8 GPUs: 7 roundings, plus the division's); FSDP2 reduces in float32
    (sharding.py), and so does this: cast the bucket up, sum, divide, and round once, back into the bucket (the
    parameters' `.grad` views, `gradient_as_bucket_view`). The float32 copy is twice the bucket (DDP's buckets
    are 25 MB) while its all-reduce runs. `state` is unused (the default process group). No annotations: DDP
    compares them with the real classes, and this module's `from __future__ import annotations` makes them strings.
    Takes a `dist.GradBucket`, returns a `torch.futures.Future` of the averaged bucket.
    """
    buffer = bucket.buffer()
    wide = buffer.float()
    world = dist.get_world_size()

    def averaged(future: torch.futures.Future) -> torch.Tensor:
        return buffer.copy_(future.value()[0].div_(world))

    return dist.all_reduce(wide, async_op=True).get_future().then(averaged)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def all_sum(values: torch.Tensor) -> torch.Tensor:
    """Element-wise sum over all processes (identity in a single process)."""
    if dist.is_initialized():
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def on_each_node(make, processes: Processes):
    """`make()` (say, fetching the model) run by rank 0 first, then by the first process of every other node: on a
    shared disk they find rank 0's result, on their own disks they make their own. Every process gets its node's
    answer (torchrun numbers the processes of a node consecutively, so its first is rank - local_rank), or raises
    its node's error: a process that failed alone would leave the others waiting in a collective for hours. The
    answers travel as JSON (`make` returns a JSON value: a path as a string), the errors as `error_json`."""

    def attempt(go: bool) -> dict | None:
        try:
            return {"result": as_json(make())} if go else None
        except Exception as e:  # handed to every process, raised by each
            return {"error": error_json(e)}

    mine = attempt(processes.is_main)
    if not processes.several:
        return raise_sent(mine)
    first = broadcast_json(mine if processes.is_main else None)
    if "error" in first:
        raise_sent(first)
    if not processes.is_main:
        mine = attempt(processes.local_rank == 0)
    return raise_sent(all_gather_json(mine)[processes.rank - processes.local_rank])


def as_json(value):
    """`value` as JSON gives it back (a tuple becomes a list), or a TypeError naming what JSON cannot hold: what
    one process sends another is JSON, never a pickle, and a process alone returns what several would."""
    return json.loads(json.dumps(value))


def error_json(error: Exception) -> dict:
    """An exception as JSON: its class's module and name, and its message (`raise_sent` rebuilds it)."""
    kind = type(error)
    return {"module": kind.__module__, "name": kind.__qualname__, "message": str(error)}


def raise_sent(sent: dict | None):
    """`sent`'s result (`{"result": ...}`), or its error (`{"error": error_json(e)}`) raised as an exception of the
    same class, found among the exception classes this process has imported (it is never imported for the
    message's sake) and made from the message alone: a process that got rank 0's error prints the line rank 0
    prints. A class it cannot find or make from a message is raised as a RuntimeError naming it."""
    if sent is None or "error" not in sent:
        return None if sent is None else sent["result"]
    error = sent["error"]
    kind = _exception_class(error["module"], error["name"])
    try:
        made = kind(error["message"]) if kind is not None else None
    except Exception:  # noqa: BLE001 -- a class whose constructor wants more than a message
        made = None
    if not isinstance(made, Exception):
        made = RuntimeError(f"{error['module']}.{error['name']}: {error['message']}")
    raise made


def _exception_class(module: str, name: str) -> type[Exception] | None:
    """The already imported subclass of Exception of this module and name, or None."""
    todo, seen = [Exception], set()
    while todo:
        kind = todo.pop()
        if kind.__module__ == module and kind.__qualname__ == name:
            return kind
        for sub in kind.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
    return None


def smallest(value: int) -> int:
    """The smallest of every process's `value`, on every process: for a decision all must take alike (say, whether
    there is memory to spare), since a process that decides otherwise would wait in a collective the others skip.
    One integer, reduced on the host group."""
    return _host_reduce(value, dist.ReduceOp.MIN)


def largest(value: int) -> int:
    """The largest of every process's `value`, on every process (say, the most batches any process runs)."""
    return _host_reduce(value, dist.ReduceOp.MAX)


def _host_reduce(value: int, op) -> int:
    if not dist.is_initialized():
        return value
    box = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(box, op=op, group=host_group())
    return int(box)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_gather_rows(
    indices: list[int], rows: list[torch.Tensor], width: int, dtype: torch.dtype, device: torch.device
) -> dict[int, torch.Tensor]:
    """Every process's `rows` ([length, width] tensors, lengths free) by their `indices`, on every process.

    One collective moves them all: each process packs its rows end to end, pads the pack to the longest
    process's, and all-gathers the packs; the rows come back as views into the gathered packs. While it runs,
    a process holds its own rows and pack besides everyone's packs: about (1 + 2 / processes) x the result.
    """
    lengths = [r.shape[0] for r in rows]
    everyone = all_gather_json([indices, lengths])  # a few ints a row: JSON on the host group
    pack = torch.zeros(max(sum(n) for _, n in everyone), width, dtype=dtype, device=device)
    if rows:
        pack[: sum(lengths)] = torch.cat(rows)
    packs = [torch.empty_like(pack) for _ in everyone]
    dist.all_gather(packs, pack)
    out = {}
    for (their_indices, their_lengths), their_pack in zip(everyone, packs, strict=True):
        pieces = their_pack[: sum(their_lengths)].split(their_lengths)
        out.update(zip(their_indices, pieces, strict=True))
    return out


def broadcast_parameters(params: list[torch.Tensor]) -> None:
    """Rank 0's values of these tensors, copied into every process's (the same shapes everywhere): how the best
    weights reach the other processes without a shared filesystem."""
    if dist.is_initialized():
        for p in params:
            dist.broadcast(p.data, src=0)


def host_group() -> dist.ProcessGroup:
    """The gloo group `setup` made (see `_host_group`)."""
    if _host_group is None:
        raise RuntimeError("the processes' host group is made by distributed.setup (strategy.choose_strategy)")
    return _host_group


def host_sum(values: list[int]) -> list[int]:
    """Element-wise sum of a few integers over every process, on the host: for votes (how many processes were asked
    to stop, or see a file), which cost no GPU sync however often they are taken. Alone: `values` themselves."""
    if not dist.is_initialized():
        return list(values)
    counts = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=host_group())
    return counts.tolist()


def broadcast_json(value=None):
    """Rank 0's `value` (anything JSON holds) on every process, sent as its UTF-8 bytes in a uint8 tensor (its
    length first): nothing is unpickled, whatever rank 0 read from a file."""
    if not dist.is_initialized():
        return value
    data = json.dumps(value).encode() if dist.get_rank() == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=0, group=host_group())
    payload = torch.empty(int(size), dtype=torch.uint8)
    if data:
        payload.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(payload, src=0, group=host_group())
    return json.loads(payload.numpy().tobytes())


def all_gather_json(value) -> list:
    """Every process's `value` (anything JSON holds), in rank order, on every process: each sends its UTF-8 bytes
    over the host group, padded to the longest (the lengths gathered first), so nothing is unpickled."""
    if not dist.is_initialized():
        return [as_json(value)]
    data = json.dumps(value).encode()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=host_group())
    longest = max(int(n) for n in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = [torch.empty(longest, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(everyone, mine, group=host_group())
    return [json.loads(t[: int(n)].numpy().tobytes()) for t, n in zip(everyone, sizes, strict=True)]


def broadcast_tensors(tensors: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Rank 0's named CPU tensors (`tensors`, None elsewhere) on every process, one broadcast each over the host
    group: their names, dtypes and shapes go first as JSON, then each tensor's bytes (any dtype, as uint8)."""
    main = dist.get_rank() == 0
    shapes = {k: [str(t.dtype).removeprefix("torch."), list(t.shape)] for k, t in tensors.items()} if main else None
    layout = broadcast_json(shapes)
    received = {}
    for name, (dtype, shape) in layout.items():
        kind = getattr(torch, dtype)
        if not isinstance(kind, torch.dtype):
            raise ValueError(f"rank 0 sent tensor {name} of an unknown dtype {dtype!r}")
        tensor = tensors[name].contiguous() if main else torch.empty(shape, dtype=kind)
        dist.broadcast(tensor.reshape(-1).view(torch.uint8), src=0, group=host_group())  # a view: fills `tensor`
        received[name] = tensor
    return received
