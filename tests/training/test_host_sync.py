"""Host-device syncs in the training loop, counted on the CPU (issue 29 c): at most one per optimizer step.

On a GPU the host queues work and runs ahead; an op that needs an answer from the GPU (`.item()`, `.tolist()`,
`bool()`, `nonzero`, ...) or a blocking copy to it (`.to("cuda")` from ordinary memory, `torch.tensor(...,
device="cuda")`) makes the host wait until the queue is empty, and the GPU idles while the host prepares the next
batch. `SimulatedGPU` runs the loop told its device is "cuda" on a CPU-only machine: every tensor stays on the CPU,
and what would wait on a GPU is written down instead:

- reads of a tensor's value on the host (counted on every tensor, host ones too: conservative);
- ops whose output's size depends on values (nonzero, masked_select, bincount, unique, repeat_interleave
  without its output's size, boolean indexing, equal), which read the GPU to size their result;
- copies to "cuda" that are not `non_blocking` from pinned memory, and tensors made from host data on "cuda".

What it cannot see is a sync inside a CUDA kernel's own host code; the device check (a real GPU, torch's sync
debug mode) covers that.
"""

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from llama_scratch import Llama, LlamaClassifier, LlamaConfig
from llama_scratch.data.batching import TokenizedSplit
from llama_scratch.model.layout import Layout
from llama_scratch.parallel.strategy import Replicated
from llama_scratch.training import loop as train
from llama_scratch.training.evaluation import evaluate
from llama_scratch.training.prefix_cache import cache_splits

READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}
SIZED_BY_VALUES = {"nonzero", "masked_select", "bincount", "unique", "_unique2", "unique_consecutive", "equal"}
MAKERS = {"tensor", "as_tensor", "asarray", "from_numpy"}  # host data made into a tensor


def on_cuda(value) -> bool:
    return (isinstance(value, str) and value.startswith("cuda")) or (
        isinstance(value, torch.device) and value.type == "cuda"
    )


class SimulatedGPU(TorchFunctionMode):
    """Code given the device "cuda", run on the CPU, its would-be syncs in `syncs` while `counting`."""

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []
        self.pinned: list[torch.Tensor] = []  # kept alive, so that their ids stay theirs
        self.counting = False
        self.reading = 0

    def note(self, what: str) -> None:
        if self.counting:
            self.syncs.append(what)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs, name = dict(kwargs or {}), getattr(func, "__name__", str(func))
        if name == "pin_memory":
            self.pinned.append(args[0])
            return args[0]
        if name in ("to", "cuda") and (name == "cuda" or any(map(on_cuda, [*args[1:], kwargs.get("device")]))):
            if not (kwargs.get("non_blocking") and any(t is args[0] for t in self.pinned)):
                self.note(f"blocking copy to the GPU ({name})")
            dtype = kwargs.get("dtype") or next((a for a in args[1:] if isinstance(a, torch.dtype)), None)
            return args[0] if dtype is None else args[0].to(dtype)
        if on_cuda(kwargs.get("device")):  # a factory: zeros, arange, ... on the device; from host data, a copy
            kwargs["device"] = "cpu"
            if name in MAKERS:
                self.note(f"blocking copy to the GPU (torch.{name})")
        if name == "new_tensor":
            self.note("blocking copy to the GPU (new_tensor)")
        if name not in READS:
            return func(*args, **kwargs)
        self.note(name)
        self.reading += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.reading -= 1


class SizedByValues(TorchDispatchMode):
    """The aten ops that read the device to size their output (or a value read from C++), told to `gpu`."""

    def __init__(self, gpu: SimulatedGPU):
        super().__init__()
        self.gpu = gpu

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense" and not self.gpu.reading:
            self.gpu.note("a value read in C++ (_local_scalar_dense)")
        if name in SIZED_BY_VALUES or name.startswith("masked_scatter"):
            self.gpu.note(name)
        if name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 3:
            self.gpu.note("repeat_interleave without output_size")
        if name == "index" and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.gpu.note("boolean indexing")
        return func(*args, **kwargs)


@contextlib.contextmanager
def simulated_gpu():
    gpu = SimulatedGPU()
    with gpu, SizedByValues(gpu):
        yield gpu


def uncounted(gpu: SimulatedGPU, fn):
    """`fn` with counting paused: host-only work (the epoch's shuffled order, drawn on the CPU's generator and read
    there once an epoch)."""

    def call(*args, **kwargs):
        was, gpu.counting = gpu.counting, False
        try:
            return fn(*args, **kwargs)
        finally:
            gpu.counting = was

    return call


def texts(n: int = 12) -> TokenizedSplit:
    ids = [[1 + (i * 7 + j) % 100 for j in range(4 + i % 5)] for i in range(n)]
    return TokenizedSplit(ids, [i % 3 for i in range(n)])


def syncs_in_an_epoch(side: str, cached: bool, grad_accum: int, monkeypatch) -> tuple[list[str], int]:
    """The would-be syncs of one epoch of 3 optimizer steps told to run on "cuda", and its steps."""
    settings = train.TrainSettings(epochs=1, batch_size=2, grad_accum=grad_accum, save_every=100, padding_side=side)
    settings.class_weights = [1.0, 2.0, 0.5]
    torch.manual_seed(0)
    clf = LlamaClassifier(Llama(LlamaConfig.from_name("tiny")), num_classes=3, train_last=2)
    split = texts(6 * grad_accum)
    if cached:
        split = cache_splits(clf, {"train": split}, 4, Replicated())["train"]
    gpu, optimizer = SimulatedGPU(), train.make_optimizer(clf, settings)  # its step is counted too
    monkeypatch.setattr(train, "epoch_plan", uncounted(gpu, train.epoch_plan))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    loop = train.Loop(clf, optimizer, scheduler, settings, Replicated(device=torch.device("cuda")), 3, None, {})
    with gpu, SizedByValues(gpu):
        gpu.counting = True
        state = train.TrainState()
        assert train.train_epoch(loop, split, state)
    return gpu.syncs, state.step


@pytest.mark.slow
@pytest.mark.parametrize("grad_accum", [1, 2])
@pytest.mark.parametrize("cached", [False, True], ids=["uncached", "cached"])
@pytest.mark.parametrize("side", ["packed", "right"])
def test_one_sync_per_optimizer_step(side, cached, grad_accum, monkeypatch):
    """Packed or padded, with the frozen-prefix cache or without, 1 or 2 micro-batches a step: the one sync a step
    is the read of its summed loss, counts and gradient norm (for the progress bar and the divergence check)."""
    syncs, steps = syncs_in_an_epoch(side, cached, grad_accum, monkeypatch)
    assert steps == 3
    assert syncs == ["tolist"] * steps


def test_the_simulation_sees_what_used_to_sync(monkeypatch):
    """The counter is not blind: the old batch (four blocking copies of the layout, a blocking copy of the token
    ids, a tensor made on the device for the rows) is caught."""
    from llama_scratch.data import batching

    def old_to_batch(split, rows, side, device):
        batch = batching.to_batch(split, rows, side, "cpu")
        texts = batch["layout"].texts
        moved = texts._replace(**{k: getattr(texts, k).to(device) for k in ("positions", "slots", "last")})
        return batch | {
            "layout": Layout.packed(moved),
            "input_ids": batch["input_ids"].to(device),
            "rows": torch.tensor(2, device=device),
        }

    monkeypatch.setattr(train, "to_batch", old_to_batch)
    syncs, steps = syncs_in_an_epoch("packed", False, 1, monkeypatch)
    assert syncs.count("blocking copy to the GPU (to)") == 4 * steps
    assert syncs.count("blocking copy to the GPU (torch.tensor)") == steps


def test_evaluation_reads_the_device_once():
    """A whole split's loss, accuracy and confusion matrix: one read at the end (no bincount a batch), and the
    figures those of a plain reference."""
    torch.manual_seed(0)
    clf = LlamaClassifier(Llama(LlamaConfig.from_name("tiny")), num_classes=3, train_last=2)
    split, settings = texts(), train.TrainSettings(batch_size=2)
    with simulated_gpu() as gpu:
        gpu.counting = True
        result = evaluate(clf, split, settings, Replicated(device=torch.device("cuda")), "val")
    assert gpu.syncs == ["tolist"]
    with torch.no_grad():
        logits = torch.cat([clf(torch.tensor([ids])) for ids in split.ids])
    labels = torch.tensor(split.labels)
    expected = torch.zeros(3, 3, dtype=torch.long)
    for t, p in zip(labels, logits.argmax(-1), strict=True):
        expected[t, p] += 1
    assert result["confusion"] == expected.tolist() and result["count"] == 12
    assert result["accuracy"] == expected.diag().sum().item() / 12
    assert result["loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, labels).item(), rel=1e-5)


def test_evaluations_inside_an_epoch_read_the_device_once_each(monkeypatch):
    """--eval-every 1 over an epoch of 3 steps: one read a step, and one an evaluation (after steps 1 and 2; the
    epoch's end is `train`'s), nothing for recording the row or choosing the best."""
    settings = train.TrainSettings(epochs=1, batch_size=2, save_every=100, eval_every=1)
    torch.manual_seed(0)
    clf = LlamaClassifier(Llama(LlamaConfig.from_name("tiny")), num_classes=3, train_last=2)
    gpu, optimizer = SimulatedGPU(), train.make_optimizer(clf, settings)
    monkeypatch.setattr(train, "epoch_plan", uncounted(gpu, train.epoch_plan))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    loop = train.Loop(clf, optimizer, scheduler, settings, Replicated(device=torch.device("cuda")), 3, None, {})
    loop.val, loop.log, loop.save_point = texts(6), lambda *a: None, lambda state: None  # no resume file here
    with gpu, SizedByValues(gpu):
        gpu.counting = True
        state = train.TrainState()
        assert train.train_epoch(loop, texts(6), state)
    assert [r["step"] for r in state.history] == [1, 2]
    assert gpu.syncs == ["tolist"] * 5
