"""The chapters' conventions (issue 40), read from the stored notebooks, nothing executed:

- a chapter holds no solution: no markdown heading of a chapter says "Solution", and a chapter with exercises
  links its worked answers in `chapters/solutions/`, a notebook that test_notebooks.py executes;
- a figure the prose quotes from a printed output is marked `<!--printed-->` right after the number, and the
  number occurs, as printed, in the same notebook's stored outputs;
- chapters 2-4 and 7-8 hold at most 60% of their 11,994 words before the issue;
- chapter 8 imports from at most 3 modules of the package, none of them chapter 9's parallel code.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

from tests.chapters.test_notebooks import EXTRAS, NOTEBOOKS, name, output_text

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = ROOT / "chapters"
SOLUTIONS = CHAPTERS / "solutions"

PRINTED = re.compile(r"([0-9][0-9,.]*%?)<!--printed-->")
HEADING = re.compile(r"^#{1,6}\s+(.*)$", re.MULTILINE)


def read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def markdown(nb: nbformat.NotebookNode) -> list[tuple[int, str]]:
    """(cell index, source) of each markdown cell."""
    return [(i, c.source) for i, c in enumerate(nb.cells) if c.cell_type == "markdown"]


def words(path: Path) -> int:
    """The words of a notebook's markdown cells, as issue 40 counts them."""
    return sum(len(source.split()) for _, source in markdown(read(path)))


def chapter(prefix: str) -> Path:
    (path,) = [p for p in NOTEBOOKS if p.name.startswith(prefix)]
    return path


# --------------------------------------------------------------------------------------------- solutions apart


@pytest.mark.parametrize("path", NOTEBOOKS, ids=name)
def test_no_chapter_heading_says_solution(path):
    for i, source in markdown(read(path)):
        for heading in HEADING.findall(source):
            assert "solution" not in heading.lower(), f"{path.name} cell {i}: heading {heading!r}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=name)
def test_exercises_link_their_solutions(path):
    """A chapter with exercises links `solutions/<its stem>.ipynb`, which exists and test_notebooks.py runs."""
    cells = markdown(read(path))
    if not any(re.search(r"^## Exercises\b", source, re.MULTILINE) for _, source in cells):
        pytest.skip(f"{path.name} has no exercises")
    link = f"(solutions/{path.name})"
    assert any(link in source for _, source in cells), f"{path.name} does not link {link[1:-1]}"
    answers = SOLUTIONS / path.name
    assert answers.is_file(), f"{path.name} links {link[1:-1]}, which does not exist"
    assert answers in EXTRAS, "test_notebooks.py executes chapters/solutions/*.ipynb"


@pytest.mark.parametrize("path", sorted(SOLUTIONS.glob("*.ipynb")), ids=name)
def test_solutions_notebook_layout(path):
    """Named after its chapter; opens with a markdown cell naming the chapter and the `sys.path` cell; one
    "### Exercise N" heading per exercise, numbered from 1."""
    assert (CHAPTERS / path.name).is_file(), f"no chapter {path.name} for {name(path)}"
    cells = read(path).cells
    number = int(path.name[:2])
    assert cells[0].cell_type == "markdown" and re.search(rf"\b[Cc]hapter {number}\b", cells[0].source)
    first_code = next(c for c in cells if c.cell_type == "code")
    assert 'sys.path.insert(0, "..")' in first_code.source, "the first code cell puts chapters/ on sys.path"
    numbers = [int(n) for _, s in markdown(read(path)) for n in re.findall(r"^### Exercise (\d+)\b", s, re.MULTILINE)]
    assert numbers and numbers == list(range(1, len(numbers) + 1)), numbers


# ---------------------------------------------------------------------------------------- printed figures


def printed_figures(text: str) -> list[str]:
    """The numbers a markdown text marks as printed: `took 48<!--printed--> s` -> ['48']."""
    return PRINTED.findall(text)


def occurs_as_printed(number: str, printed: str) -> bool:
    """Whether `number` occurs in `printed` as a whole number: `48` not inside `148`, `1,048`, `0.48` or `48.5`."""
    before = r"(?<![0-9.,])" if number[0].isdigit() else ""
    after = r"(?![0-9]|[.,][0-9])" if number[-1].isdigit() else ""
    return re.search(before + re.escape(number) + after, printed) is not None


def stored_outputs(nb: nbformat.NotebookNode) -> str:
    return "\n".join(output_text(o) for c in nb.cells if c.cell_type == "code" for o in c.outputs)


@pytest.mark.parametrize(
    ("number", "text", "found"),
    [
        ("48", "the run took 48 s", True),
        ("48", "the run took 148 s", False),
        ("48", "the run took 48.5 s", False),
        ("48", "epoch 3: 48.", True),
        ("48", "(48)", True),
        ("48", "1,048 rows", False),
        ("48", "0.48", False),
        ("1,038", "1,038 GiB in all", True),
        ("1,038", "11,038 GiB", False),
        ("97.67%", "test accuracy 97.67%", True),
        ("97.67%", "test accuracy 97.675%", False),
        ("3.0e-07", "max error 3.0e-07", True),
        ("7", "7 not in the vocabulary", True),
        ("7", "17 not in the vocabulary", False),
    ],
)
def test_occurs_as_printed(number, text, found):
    assert occurs_as_printed(number, text) is found


def test_printed_figures_are_read_from_the_marker():
    text = "the run took 48<!--printed--> s, 97.67%<!--printed--> test, 1,038<!--printed--> GiB; 8,192 positions"
    assert printed_figures(text) == ["48", "97.67%", "1,038"]
    assert printed_figures("about 1.870<!--printed--> GiB.") == ["1.870"]
    assert printed_figures("no marker: 48 s") == []


@pytest.mark.parametrize("path", NOTEBOOKS + EXTRAS, ids=name)
def test_printed_figures_match_the_stored_outputs(path):
    nb = read(path)
    printed = stored_outputs(nb)
    missing = [
        f"cell {i}: {number}"
        for i, source in markdown(nb)
        for number in printed_figures(source)
        if not occurs_as_printed(number, printed)
    ]
    assert not missing, f"{name(path)}: marked as printed but not in its stored outputs: {missing}"


# ------------------------------------------------------------------------------------------- length, imports

WORDS_BEFORE = 11_994  # chapters 2-4 and 7-8 when issue 40 was filed


def test_chapters_2_to_4_and_7_to_8_hold_60_percent_of_their_words():
    counts = {chapter(n).name: words(chapter(n)) for n in ("02", "03", "04", "07", "08")}
    for chapter_name, n in counts.items():
        print(f"{chapter_name:<40} {n:6,} words")
    total = sum(counts.values())
    print(f"{'together':<40} {total:6,} words (at most {WORDS_BEFORE * 6 // 10:,})")
    assert total <= WORDS_BEFORE * 6 // 10, counts


def package_modules(sources: list[str]) -> set[str]:
    """The `llama_scratch` modules that these code cells import from (IPython's `%` and `!` lines skipped).

    `from llama_scratch import training` counts as the module `llama_scratch.training`; `from llama_scratch
    import Llama` as `llama_scratch`."""
    found = set()
    for source in sources:
        code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.split(".")[0] == "llama_scratch"}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                if node.module.split(".")[0] != "llama_scratch":
                    continue
                folder = ROOT / node.module.replace(".", "/")
                for alias in node.names:
                    is_module = (folder / f"{alias.name}.py").is_file() or (folder / alias.name).is_dir()
                    found.add(f"{node.module}.{alias.name}" if is_module else node.module)
    return found


def test_package_modules_are_read_from_imports():
    cells = [
        "import torch\nfrom llama_scratch import Llama, LlamaConfig",
        "%matplotlib inline\nfrom llama_scratch.data.batching import collate\nimport llama_scratch.generate",
        "from llama_scratch import training\nfrom our_llama import OurLlama",
    ]
    assert package_modules(cells) == {
        "llama_scratch",
        "llama_scratch.data.batching",
        "llama_scratch.generate",
        "llama_scratch.training",
    }


def test_chapter_8_imports_at_most_3_package_modules():
    cells = [c.source for c in read(chapter("08")).cells if c.cell_type == "code"]
    modules = package_modules(cells)
    print("chapter 8 imports from:", sorted(modules))
    assert len(modules) <= 3, sorted(modules)
    assert not any(m.startswith("llama_scratch.parallel") for m in modules), "none of chapter 9's parallel code"
