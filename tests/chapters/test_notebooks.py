"""The chapter notebooks run top to bottom on CPU, and their stored outputs hold nothing machine-specific.

Each notebook is executed in a fresh `python3` kernel (from this environment) with its own folder as the working
directory, exactly as Jupyter runs it for a reader: `chapters/` for a chapter, `chapters/solutions/` for the worked
answers to a chapter's exercises, `chapters/appendix/` for reference notebooks. Any error in any cell fails its
test. Outputs are not written back.

To refresh the stored outputs after changing a notebook or the package (from the repository root):

    python tests/chapters/test_notebooks.py              # every chapter
    python tests/chapters/test_notebooks.py 03 07        # chapters whose names start with these
    python tests/chapters/test_notebooks.py solutions/08 # a solutions notebook (appendix/ likewise)
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from pathlib import Path

import nbclient
import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = ROOT / "chapters"
NOTEBOOKS = sorted(CHAPTERS.glob("[0-9][0-9]_*.ipynb"))
# The worked answers (one notebook per chapter with exercises) and the reference notebooks, run like the chapters.
EXTRAS = sorted(CHAPTERS.glob("solutions/*.ipynb")) + sorted(CHAPTERS.glob("appendix/*.ipynb"))
KERNEL = "python3"
CELL_TIMEOUT = 600  # seconds; the slowest cells (chapter 8's training) take about a minute on two CPU cores

# Progress bars (tqdm writes them to stderr, redrawn with \r) and tqdm's note that ipywidgets is missing change
# on every run; they are dropped from the stored outputs.
_PROGRESS = re.compile(r"\r|\d+%\|")
_TQDM_NOTE = "IProgress not found"


def execute(path: Path) -> nbformat.NotebookNode:
    """Run every cell of the notebook at `path` in a fresh kernel; raises CellExecutionError on a failing cell."""
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT,
        kernel_name=KERNEL,
        resources={"metadata": {"path": str(path.parent)}},
        record_timing=False,
    )
    client.execute()
    return nb


def machine_specific(text: str) -> list[str]:
    """Absolute paths of this machine that `text` mentions (it should mention none)."""
    places = {str(ROOT), str(Path.home()), str(Path(sys.prefix)), tempfile.gettempdir() + "/", "site-packages"}
    return sorted(p for p in places if p in text)


def output_text(output: dict) -> str:
    if output.get("output_type") == "stream":
        return output["text"]
    if output.get("output_type") == "error":
        return "\n".join([output["ename"], output["evalue"], *output["traceback"]])
    return "\n".join(v for k, v in output.get("data", {}).items() if k.startswith("text/") and isinstance(v, str))


def clean(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Drop progress bars and per-run metadata from an executed notebook, and refuse machine-specific output."""
    for i, cell in enumerate(nb.cells):
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        kept = []
        for output in cell.outputs:
            if output.get("output_type") == "stream" and output["name"] == "stderr":
                lines = [line for line in output["text"].splitlines(keepends=True) if not _PROGRESS.search(line)]
                text = "".join(lines)
                if _TQDM_NOTE in text:  # the warning and the source line it quotes
                    text = ""
                if not text.strip():
                    continue
                output["text"] = text
            if found := machine_specific(output_text(output)):
                raise ValueError(f"cell {i} prints machine-specific paths {found}: {output_text(output)[:300]!r}")
            previous = kept[-1] if kept else None
            if (
                previous
                and output.get("output_type") == previous.get("output_type") == "stream"
                and (output["name"] == previous["name"])
            ):  # how a print is cut into messages depends on timing; store one output per stream
                previous["text"] += output["text"]
            else:
                kept.append(output)
        cell.outputs = kept
    nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": KERNEL}
    nb.metadata["language_info"] = {"name": "python", "file_extension": ".py", "mimetype": "text/x-python"}
    return nb


def test_chapters_are_numbered_in_reading_order():
    numbers = [int(p.name[:2]) for p in NOTEBOOKS]
    assert numbers == list(range(1, 13)), [p.name for p in NOTEBOOKS]
    readme = (CHAPTERS / "README.md").read_text()
    assert all(p.name in readme for p in NOTEBOOKS), "chapters/README.md lists every chapter"


def name(path: Path) -> str:
    """`08_finetuning_sms_spam` for a chapter, `solutions/08_finetuning_sms_spam` for its answers."""
    return path.relative_to(CHAPTERS).with_suffix("").as_posix()


@pytest.mark.parametrize("path", NOTEBOOKS + EXTRAS, ids=name)
def test_stored_outputs_are_complete_and_portable(path):
    """Stored as executed top to bottom, with no path of the machine that ran it."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "re-run the notebook from the top"
    for i, cell in enumerate(code):
        for output in cell.outputs:
            assert output.get("output_type") != "error", f"code cell {i + 1} stored an error"
            assert not machine_specific(output_text(output)), f"code cell {i + 1}: {output_text(output)[:300]}"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS + EXTRAS, ids=name)
def test_chapter_runs(path):
    execute(path)


def main(prefixes: list[str]) -> int:
    """Execute the chosen chapters and store them with their outputs; print each one's time."""
    chosen = [p for p in NOTEBOOKS + EXTRAS if not prefixes or any(name(p).startswith(x) for x in prefixes)]
    total = 0.0
    for path in chosen:
        start = time.perf_counter()
        nb = clean(execute(path))
        seconds = time.perf_counter() - start
        total += seconds
        nbformat.validate(nb)
        nbformat.write(nb, path)
        print(f"{name(path):<50} {seconds:6.1f} s")
    print(f"{'total':<50} {total:6.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
