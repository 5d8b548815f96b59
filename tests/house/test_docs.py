"""The README and docs/ say only what is true: every default they name for a flag is the one the command's parser
(and TrainSettings) holds, every link and path leads somewhere, the Python examples run, the README stays a
front page, both READMEs list every chapter, and no shell line in them, docs/ or a chapter breaks when copied.

The one format for a default is a flags table: a header `| flag of `llama-scratch CMD` | default | ... |`, a row
per flag. Outside those tables no page names a flag's default."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import re
from collections import Counter
from pathlib import Path
from unittest import mock

import pytest

import llama_scratch
from llama_scratch.__main__ import COMMANDS
from llama_scratch.finetune_settings import build_parser
from llama_scratch.training.loop import TrainSettings

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 150


# ---------------------------------------------------------------------------------------------- reading markdown


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of everything outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def cells(line: str) -> list[str]:
    """A table row's cells; `\\|` inside a cell is a literal bar."""
    inner = line.strip().removeprefix("|").removesuffix("|")
    return [c.replace("\\|", "|").strip() for c in re.split(r"(?<!\\)\|", inner)]


def tables(path: Path) -> list[list[list[str]]]:
    """Every table outside code: its header row, then its body rows (the --- row dropped)."""
    found, rows, last = [], [], None
    for number, line in prose_lines(path):
        if line.lstrip().startswith("|"):
            if last != number - 1:
                rows = []
                found.append(rows)
            rows.append(cells(line))
            last = number
    return [[t[0], *t[2:]] for t in found if len(t) >= 2]


def code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:e-?\d+)?(?!\w)(?!\.\d)")


def numbers(text: str) -> set[float]:
    return {float(n.replace(",", "")) for n in NUMBER.findall(text)}


# ---------------------------------------------------------------------------------------------- (a) defaults


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


@functools.cache
def parser_of(command: str) -> argparse.ArgumentParser:
    """The parser a subcommand's module builds, caught as its main() calls parse_args (nothing else runs)."""
    module, _, _ = COMMANDS[command]
    if module == "finetune_classifier":
        return build_parser()

    def caught(self, *args, **kwargs):
        raise _Parsed(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", caught):
        try:
            importlib.import_module(f"llama_scratch.{module}").main([])
        except _Parsed as e:
            return e.parser
    raise AssertionError(f"llama_scratch.{module}.main() never parsed its arguments")


def flag_rows() -> list[tuple[str, str, str, str]]:
    """(where, command, flag, default cell) of every row of every flags table."""
    rows = []
    for page in PAGES:
        for header, *body in tables(page):
            named = re.fullmatch(r"flag of `llama-scratch (\w+)`", header[0])
            if not named or len(header) < 2 or header[1] != "default":
                continue
            for row in body:
                flag = re.search(r"`(--[\w-]+)", row[0])
                assert flag, f"{page.name}: a flags table row names no flag: {row}"
                rows.append((f"{page.relative_to(ROOT)} {flag.group(1)}", named.group(1), flag.group(1), row[1]))
    return rows


def expected_default(command: str, action: argparse.Action) -> object | None:
    """What a flag's default cell must start with; None when the code's default is a rule told in words."""
    if action.required:
        return "required"
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if action.default is not None:
        return action.default
    if COMMANDS[command][0] == "finetune_classifier":
        return {f.name: f.default for f in dataclasses.fields(TrainSettings)}.get(action.dest.split(".")[-1])
    return None


def same(shown: str, value: object) -> bool:
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            return float(shown) == float(value)
        except ValueError:
            return False
    return shown == str(value)


@pytest.mark.parametrize("where, command, flag, cell", flag_rows(), ids=[row[0] for row in flag_rows()])
def test_every_default_in_the_docs_is_the_parsers(where, command, flag, cell):
    """A value is compared with the parser's default (or TrainSettings', where the flag's own is None: `--epochs`,
    `--lr`); a rule in words (`--model`, `--split`) may name only figures and code that the flag's help names.
    No figure beyond those: a stale one fails."""
    parser = parser_of(command)
    action = parser._option_string_actions.get(flag)
    assert action is not None, f"{where}: `llama-scratch {command}` has no flag {flag}"
    plain, helped = cell.replace("`", ""), action.help or ""
    expected = expected_default(command, action)
    if expected is not None:
        shown = re.match(r"[^\s,;:(]+", plain)
        assert shown and same(shown.group(), expected), f"{where}: the docs say {cell!r}, the code {expected!r}"
    allowed = numbers(helped) | (numbers(str(expected)) if expected is not None else set())
    assert numbers(plain) <= allowed, f"{where}: {cell!r} names figures that neither the code nor the help has"
    for code in code_spans(cell):
        if code.startswith("--"):
            assert code.split()[0] in parser._option_string_actions, f"{where}: no flag {code}"
        elif code != str(expected):
            assert code.lower() in helped.lower(), f"{where}: {code!r} is not in the flag's help: {helped!r}"


def test_every_flag_of_every_command_is_in_a_flags_table():
    documented = {(command, flag) for _, command, flag, _ in flag_rows()}
    for command, (_, first, _) in COMMANDS.items():
        if first:  # `plan` is `finetune --plan`: the same flags, documented once
            continue
        for action in parser_of(command)._actions:
            if action.option_strings and action.dest != "help":
                flag = action.option_strings[0]
                assert (command, flag) in documented, f"`llama-scratch {command} {flag}` is in no flags table"


def test_no_page_names_a_default_outside_a_flags_table():
    """One checkable format: `(default: X)` or "defaults to X" in prose would be a second, unchecked one."""
    said = re.compile(r"\(default\b|\bdefaults? to\b|\bby default\b", re.IGNORECASE)
    for page in PAGES:
        for number, line in prose_lines(page):
            if not line.lstrip().startswith("|"):
                assert not said.search(line), f"{page.name}:{number}: a default named in prose: {line.strip()}"


def test_the_two_spellings_table_is_the_command_table():
    rows = next(body for header, *body in tables(ROOT / "docs" / "finetuning.md") if header[0] == "subcommand")
    shown = {}
    for row in rows:
        sub = re.fullmatch(r"`llama-scratch (\w+)`", row[0]).group(1)
        module = re.fullmatch(r"`python -m llama_scratch\.(\w+)((?: --\w+)*)`", row[1])
        shown[sub] = (module.group(1), module.group(2).split())
    assert shown == {name: (module, first) for name, (module, first, _) in COMMANDS.items()}


# ---------------------------------------------------------------------------------------------- (b) links and names


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: link text only, no backticks, lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def anchors(path: Path) -> set[str]:
    seen, found = Counter(), set()
    for _, line in prose_lines(path):
        if heading := re.match(r"#{1,6} (.+)", line):
            slug = github_anchor(heading.group(1))
            found.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
            seen[slug] += 1
    return found


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_leads_to_a_file_and_heading(page):
    for number, line in prose_lines(page):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            where = (page.parent / path).resolve() if path else page
            assert where.exists(), f"{page.name}:{number}: {target} does not exist"
            if anchor:
                assert where.suffix == ".md", f"{page.name}:{number}: an anchor into a non-markdown file: {target}"
                assert anchor in anchors(where), f"{page.name}:{number}: {where.name} has no heading #{anchor}"


REPO_PATH = re.compile(r"(?<![\w/.-])((?:llama_scratch|tests|benchmarks|chapters|docs)/[\w./-]*)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_path_and_module_named_exists(page):
    """Paths into the repository (`llama_scratch/model/lora.py`, tests/planning/test_plan.py) and dotted names
    (`llama_scratch.model.lora.LoRALinear`): after the move into folders, a stale one fails here."""
    text = "\n".join(line for _, line in prose_lines(page))
    for path in REPO_PATH.findall(text):
        path = path.rstrip(".")
        assert (ROOT / path).exists(), f"{page.name}: {path} does not exist"
    for dotted in {c for c in code_spans(text) if re.fullmatch(r"llama_scratch(\.\w+)+", c)}:
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                found = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for name in parts[cut:]:
                assert hasattr(found, name), f"{page.name}: {dotted}: no {name}"
                found = getattr(found, name)
            break
    for header, *body in tables(page):  # a folder's row names files in that folder
        if header[0] != "folder":
            continue
        for row in body:
            folder = ROOT / code_spans(row[0])[0]
            for name in (c for c in code_spans(row[1]) if c.endswith(".py")):
                assert (folder / name).is_file(), f"{page.name}: {folder.relative_to(ROOT)}/{name} does not exist"


def test_the_api_tables_name_what_the_package_holds():
    page = ROOT / "docs" / "python_api.md"
    for header, *body in tables(page):
        if header[:2] == ["name", "what it is"]:  # the public names, each in the module the table says
            names = [code_spans(row[0])[0] for row in body]
            assert sorted(names) == sorted(llama_scratch.__all__)
            for row, name in zip(body, names, strict=True):
                home = code_spans(row[2])[0].removesuffix(".py").replace("/", ".")
                assert getattr(llama_scratch, name).__module__ == home, name
        if header[:2] == ["function", "module"]:  # the stable functions
            for row in body:
                module = importlib.import_module(code_spans(row[1])[0])
                for name in code_spans(row[0]):
                    assert hasattr(module, name), f"{module.__name__} has no {name}"


# ---------------------------------------------------------------------------------------------- (c) examples


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """(first line, source) of each ```python block not marked `<!-- not run: why -->` on the line above it."""
    blocks, lines = [], path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = lines.index("```", i + 1)
            above = next((line for line in reversed(lines[:i]) if line.strip()), "")
            if not above.startswith("<!-- not run:"):
                blocks.append((i + 2, "\n".join(lines[i + 1 : end])))
            i = end
        i += 1
    return blocks


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_python_examples_run(page, tmp_path, monkeypatch):
    """A page's examples in order, in one namespace, in an empty directory (they write weights/ and runs/)."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "docs_example"}
    for line, source in python_blocks(page):
        exec(compile(source, f"{page.relative_to(ROOT)}:{line}", "exec"), namespace)


def test_some_examples_are_left_out_only_with_a_reason():
    for page in PAGES:
        for number, line in prose_lines(page):
            if line.startswith("<!-- not run"):
                assert re.fullmatch(r"<!-- not run: .{10,} -->", line), f"{page.name}:{number}: {line}"


# ---------------------------------------------------------------------------------------------- (d) the front page


def test_readme_is_a_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the reference goes in docs/"


def test_readme_test_command_is_what_ci_runs():
    """The README says its second command is exactly what CI runs: the steps of .ci/run, in order, without pip's
    --quiet."""
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    start = ci.index(next(line for line in ci if line.startswith("pip install") and "-e" in line))
    steps = [line.replace(" --quiet", "") for line in ci[start:]]
    command = next(line for line in README.read_text().splitlines() if "ruff format --check . && pytest" in line)
    assert command.split(" && ")[2:] == steps


# ---------------------------------------------------------------------------------------------- (e) the chapters

CHAPTERS_README = ROOT / "chapters" / "README.md"
NOTEBOOKS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
SHELL_FENCES = {"bash", "sh", "shell", "console", "zsh"}


def markdown_cells(notebook: Path) -> list[tuple[int, str]]:
    """(cell index, source) of a notebook's markdown cells."""
    cells_ = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    return [(i, "".join(c["source"])) for i, c in enumerate(cells_) if c["cell_type"] == "markdown"]


def shell_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line inside a ```bash (or sh, shell, console, zsh) fence of markdown `text`."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = line.strip().removeprefix("```").strip() if fence is None else None
            continue
        if fence in SHELL_FENCES:
            out.append((number, line))
    return out


def shell_texts() -> list[tuple[str, str]]:
    """(where, markdown) of every page and chapter cell a reader copies commands from."""
    pages = [(p.relative_to(ROOT).as_posix(), p.read_text(encoding="utf-8")) for p in [*PAGES, CHAPTERS_README]]
    chapters = [
        (f"{nb.relative_to(ROOT).as_posix()} cell {i}", text) for nb in NOTEBOOKS for i, text in markdown_cells(nb)
    ]
    return pages + chapters


def test_the_shell_checks_see_every_page_and_chapter():
    """The check below must not pass by looking at nothing: it reads shell lines from the pages and the chapters."""
    texts = shell_texts()
    assert len(NOTEBOOKS) >= 12 and {w.split(" cell ")[0] for w, _ in texts} >= {
        nb.relative_to(ROOT).as_posix() for nb in NOTEBOOKS
    }
    assert shell_lines("```bash\nls \\\\\n```\n```python\nx = 1\n```") == [(2, "ls \\\\")]
    assert any(shell_lines(text) for where, text in texts if " cell " in where)  # chapters have shell blocks too


def test_no_shell_line_ends_with_a_doubled_backslash():
    """A shell line is continued by one backslash; a doubled one (a Python string's escape, pasted into markdown)
    ends the command with a literal backslash, and the copied command breaks."""
    for where, text in shell_texts():
        for number, line in shell_lines(text):
            assert not line.rstrip().endswith("\\\\"), f"{where}, line {number}: a doubled backslash: {line.strip()}"


def chapter_title(notebook: Path) -> str:
    """'Configuration and size' from the notebook's first line, '# Chapter 1: Configuration and size'."""
    first = markdown_cells(notebook)[0][1].splitlines()[0]
    heading = re.fullmatch(rf"# Chapter {int(notebook.name[:2])}: (.+)", first)
    assert heading, f"{notebook.name} opens with {first!r}, not '# Chapter {int(notebook.name[:2])}: ...'"
    return heading.group(1)


@pytest.mark.parametrize("page", [README, CHAPTERS_README], ids=["README.md", "chapters/README.md"])
def test_every_chapter_is_listed_by_its_title(page):
    """Both READMEs list every chapter, in order, as `N. [its first heading](its file)`."""
    text = page.read_text(encoding="utf-8")
    where = "chapters/" if page == README else ""
    listed = re.findall(r"^(\d+)\. \[([^\]]+)\]\(([^)]+\.ipynb)\)", text, re.MULTILINE)
    expected = [(str(int(nb.name[:2])), chapter_title(nb), where + nb.name) for nb in NOTEBOOKS]
    assert listed == expected, f"{page.relative_to(ROOT)} lists {listed}, the chapters are {expected}"
