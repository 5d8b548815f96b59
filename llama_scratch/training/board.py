"""`--tensorboard DIR`: each history row written as TensorBoard scalars at its optimizer step, to watch a run live.

TensorBoard is optional (`pip install 'llama-scratch[tensorboard]'`): `torch.utils.tensorboard` is imported only
when the flag is given, since it needs the `tensorboard` package, which a run without the flag has no use for.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

# history row column -> TensorBoard tag: one chart per measure, training and validation side by side.
TAGS = {
    "train_loss": "loss/train",
    "val_loss": "loss/val",
    "train_accuracy": "accuracy/train",
    "val_accuracy": "accuracy/val",
    "val_macro_f1": "macro_f1/val",
}
INSTALL = "pip install 'llama-scratch[tensorboard]' (or pip install tensorboard)"


def open_board(directory: Path | None, writes: bool) -> Callable[[dict], None] | None:
    """What writes each history row to `directory` (None without --tensorboard). Every process checks that the
    package is there, so all refuse alike, before anything is loaded; only the one that `writes` (rank 0) opens
    a writer. A missing package is a ValueError of one line naming the flag and the install command."""
    if directory is None:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError(f"--tensorboard needs the tensorboard package, which is not installed: {INSTALL}") from None
    if not writes:
        return None
    writer = SummaryWriter(log_dir=str(directory))

    def write(row: dict) -> None:
        for column, tag in TAGS.items():
            writer.add_scalar(tag, row[column], row["step"])
        writer.flush()  # a row every evaluation: on disk now, not after the writer's two minutes

    return write
