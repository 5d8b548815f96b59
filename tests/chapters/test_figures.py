"""The chapters' drawn diagrams: `chapters/figures/draw.py` regenerates every figure the notebooks show, every
figure a notebook references is in the repository, and the GPT-2 -> Llama-3 bridge table names what changed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = ROOT / "chapters"
FIGURES = CHAPTERS / "figures"
REFERENCE = re.compile(r"\]\(figures/([\w.-]+\.png)\)")


def references() -> dict[str, set[str]]:
    """Chapter notebook name -> the figure files its markdown cells show."""
    found = {}
    for path in sorted(CHAPTERS.glob("[0-9][0-9]_*.ipynb")):
        cells = nbformat.read(path, as_version=4).cells
        names = {m for c in cells if c.cell_type == "markdown" for m in REFERENCE.findall(c.source)}
        if names:
            found[path.name] = names
    return found


@pytest.mark.slow
def test_draw_writes_every_referenced_figure(tmp_path):
    """The script regenerates every figure the chapters show, and the committed files are the ones it writes."""
    subprocess.run([sys.executable, str(FIGURES / "draw.py"), str(tmp_path)], check=True, capture_output=True)
    written = {p.name for p in tmp_path.glob("*.png")}
    shown = set().union(*references().values())
    assert shown <= written, f"referenced but not drawn: {sorted(shown - written)}"
    assert written == {p.name for p in FIGURES.glob("*.png")}, "rerun `python chapters/figures/draw.py`"
    for name in written:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_referenced_figure_exists_and_is_small():
    for chapter, names in references().items():
        for name in names:
            path = FIGURES / name
            assert path.is_file(), f"{chapter} shows figures/{name}, which does not exist"
            assert path.stat().st_size < 200_000, f"figures/{name} is {path.stat().st_size:,} bytes"


def test_at_least_ten_figures_in_seven_chapters():
    found = references()
    assert len(set().union(*found.values())) >= 10
    assert len(found) >= 7


def test_the_bridge_table_names_the_changes():
    """Chapter 4 holds the GPT-2 -> Llama-3 table: a markdown table whose rows name each change."""
    cells = nbformat.read(CHAPTERS / "04_the_whole_model.ipynb", as_version=4).cells
    tables = [c.source for c in cells if c.cell_type == "markdown" and "| GPT-2" in c.source]
    assert len(tables) == 1
    rows = [line for line in tables[0].splitlines() if line.startswith("|")]
    text = "\n".join(rows)
    for name in ("LayerNorm", "RMSNorm", "GELU", "SwiGLU", "grouped-query attention", "RoPE", "50,257", "128,256"):
        assert name in text, f"the bridge table does not name {name}"
    for paper in (
        "Zhang & Sennrich 2019",
        "Shazeer 2020",
        "Su et al. 2021",
        "Ainslie et al. 2023",
        "Dubey et al. 2024",
    ):
        assert paper in text, f"the bridge table does not cite {paper}"
    assert all(len(row.strip("|").split("|")) == 5 for row in rows), "every row: change, GPT-2, Llama-3, why, paper"
