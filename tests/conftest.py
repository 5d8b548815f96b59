import csv
import os
from pathlib import Path

# Under pytest-xdist (`pytest -n 2`, what CI runs) each worker is one process per core: one thread each, or torch's
# threads in two workers fight over the same cores, which makes compute-bound tests several times slower. Set before
# torch is imported, so that the notebooks' kernels and the subprocesses the tests start inherit it too.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from llama_scratch.data.labelled import load_sms_spam

# `pytest -m gpu` runs tests/gpu/test_gpu.py on CUDA. Without a GPU they are skipped, unless this variable is "cpu":
# then they run on the CPU in float32, so their logic can be checked on any machine (CI, a laptop). Only the test that
# needs two CUDA devices still skips there.
GPU_OVERRIDE = "LLAMA_SCRATCH_TEST_GPU"


def gpu_override() -> str | None:
    """The value of LLAMA_SCRATCH_TEST_GPU: None (unset or empty) or "cpu"; anything else is a usage error."""
    value = os.environ.get(GPU_OVERRIDE) or None
    if value not in (None, "cpu"):
        raise pytest.UsageError(f"{GPU_OVERRIDE}={value!r}: the only value it takes is 'cpu' (or leave it unset)")
    return value


def pytest_configure(config: pytest.Config) -> None:
    """Under `pytest -n N`, fetch SmolLM2 once, here in the controlling process, before the workers start: tests and
    chapters on two workers would otherwise both find it missing and download and convert it at the same moment.
    (Offline, nothing is fetched; the tests that need it then skip or fail as they would alone.)"""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        from llama_scratch.sources.fetch import SMOLLM2_DIR, DownloadError, fetch_smollm2

        try:  # the GGUF into the cache, converted into the repository's weights/, where the chapters look
            fetch_smollm2(Path(__file__).resolve().parent.parent / SMOLLM2_DIR, quiet=True)
        except (DownloadError, OSError) as e:
            print(f"conftest: SmolLM2 was not fetched before the workers started ({e})")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the `gpu` tests where there is no CUDA device and no CPU override: reported as skipped, never failed."""
    if gpu_override() or torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU ({GPU_OVERRIDE}=cpu runs it on the CPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under `-m gpu`, test modules holding no gpu test are not imported: none of their tests would run, and the GPU
    machine lacks test-only packages some of them import at the top (gguf, llama-models, nbclient)."""
    if config.getoption("markexpr") != "gpu" or not collection_path.name.startswith("test_"):
        return None
    return collection_path.suffix == ".py" and "mark.gpu" not in collection_path.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def gpu_device() -> torch.device:
    """The device the `gpu` tests run on: cuda:0, or the CPU under LLAMA_SCRATCH_TEST_GPU=cpu."""
    return torch.device("cpu") if gpu_override() else torch.device("cuda", 0)


@pytest.fixture(scope="session")
def gpu_dtype(gpu_device: torch.device) -> torch.dtype:
    """What a run computes in there: bfloat16 on the GPU (what --dtype auto picks), float32 on the CPU override (no
    native bfloat16 on the CPUs we test on)."""
    return torch.bfloat16 if gpu_device.type == "cuda" else torch.float32


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same random state, so failures reproduce."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def small_csv(tmp_path_factory) -> Path:
    """96 real SMS messages, half spam, as a user's CSV file with a header."""
    sms = load_sms_spam()
    ham = [t for t, y in zip(sms.texts, sms.labels, strict=True) if y == 0][:48]
    spam = [t for t, y in zip(sms.texts, sms.labels, strict=True) if y == 1][:48]
    path = tmp_path_factory.mktemp("data") / "sms.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["message", "category"])
        w.writerows([(t, "ham") for t in ham] + [(t, "spam") for t in spam])
    return path
