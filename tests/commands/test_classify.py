"""classify on a user's files: tables in, a CSV of every class's probability out, and with --labels the file's
accuracy, per-class figures and confusion matrix. One tiny run is trained for the whole module; files that
training and classify must read alike (a csv-quoted TSV, JSON keys found by their values) train a run of their own.
"""

import csv
import json
import re
from pathlib import Path

import pytest

from llama_scratch import classify, export_hf, finetune_classifier, generate
from llama_scratch.data.inputs import choose_columns, known_label, read_inputs
from llama_scratch.data.labelled import load_dataset
from tests.commands.test_finetune import args_for


@pytest.fixture(scope="module")
def run(small_csv, tmp_path_factory):
    out = tmp_path_factory.mktemp("classify") / "run"
    assert finetune_classifier.main(args_for(small_csv, out, "--max-steps", "1")) == 0
    return out


def classify_ok(capsys, *argv) -> tuple[str, str]:
    """Run classify, expect success, return its (stdout, stderr)."""
    capsys.readouterr()
    assert classify.main(["--checkpoint", *map(str, argv)]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def classify_fails(capsys, *argv) -> str:
    """Run classify, expect one `error:` line and exit status 2, return that line."""
    capsys.readouterr()
    assert classify.main(["--checkpoint", *map(str, argv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def read_rows(path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_a_csv_in_gives_every_class_probability_out_and_the_stdout_predictions(run, small_csv, tmp_path, capsys):
    out, err = classify_ok(capsys, run, "--file", small_csv, "--output", tmp_path / "scored.csv")
    assert out == "" and "wrote 96 rows" in err
    rows = read_rows(tmp_path / "scored.csv")
    with open(small_csv, newline="") as f:
        texts = [row["message"] for row in csv.DictReader(f)]
    assert list(rows[0]) == ["message", "category", "predicted", "probability", "p_ham", "p_spam"]
    assert [r["message"] for r in rows] == texts  # one row per input, in input order
    for r in rows:
        probs = {name: float(r[f"p_{name}"]) for name in ("ham", "spam")}
        assert sum(probs.values()) == pytest.approx(1, abs=1e-5)
        assert r["predicted"] == max(probs, key=probs.get) and float(r["probability"]) == max(probs.values())
    printed, _ = classify_ok(capsys, run, "--file", small_csv)
    assert [line.split("\t")[0] for line in printed.splitlines()] == [r["predicted"] for r in rows]


def test_labels_print_the_accuracy_and_confusion_matrix_of_the_output_csv(run, small_csv, tmp_path, capsys):
    report, _ = classify_ok(capsys, run, "--file", small_csv, "--labels", "--output", tmp_path / "scored.csv")
    rows = read_rows(tmp_path / "scored.csv")
    correct = sum(r["predicted"] == r["category"] for r in rows)
    assert f"accuracy {correct / len(rows):.2%} ({correct} of {len(rows)})" in report
    lines = report.splitlines()
    assert lines[1].split() == ["class", "precision", "recall", "F1", "support"]
    assert [line.split()[0] for line in lines[2:4]] == ["ham", "spam"] and lines[2].split()[-1] == "48"
    at = lines.index("confusion matrix (rows: true class, columns: predicted):")
    assert lines[at + 1].split() == ["ham", "spam"]
    matrix = [[int(c) for c in line.split()[1:]] for line in lines[at + 2 :]]
    assert len(matrix) == 2 and sum(map(sum, matrix)) == len(rows) and matrix[0][0] + matrix[1][1] == correct
    assert matrix[1][0] == sum(r["category"] == "spam" and r["predicted"] == "ham" for r in rows)  # rows are true


def test_an_unknown_label_is_one_error_naming_the_line_and_the_known_labels(run, tmp_path, capsys):
    data = tmp_path / "new.csv"
    data.write_text("text,label\nhello there,ham\nwin a prize,spamm\n")
    err = classify_fails(capsys, run, "--file", data, "--labels", "--output", tmp_path / "scored.csv")
    assert "new.csv line 3" in err and "'spamm'" in err and "(ham, spam)" in err
    assert not (tmp_path / "scored.csv").exists()


def test_several_labels_in_a_cell_are_refused_for_a_run_of_one_label_per_text(run, tmp_path, capsys, monkeypatch):
    """A --multi-label file's `a;b` cell scored against a single-label run: one line naming the file, the row and the
    value, before the model loads (the column finder found the column, as it finds a --multi-label run's); a class
    whose own name holds ';' (a run trained on it without --multi-label) is still that class."""
    monkeypatch.setattr(classify, "load_classifier", lambda *a, **k: pytest.fail("the model was loaded"))
    several = (
        "label 'ham;spam' is several labels (;-separated), but this classifier has one label per text (its run was "
        "not --multi-label); give each text one label"
    )
    for name, text, row in (
        ("tagged.csv", "text,label\nwin a prize now,spam\nsee you at lunch,ham;spam\n", 3),
        ("headerless.csv", "win a prize now,spam\nsee you at lunch,ham;spam\nrunning late,ham\n", 2),
        ("tagged.jsonl", '{"text": "win a prize now", "label": "spam"}\n{"text": "lunch?", "label": "ham;spam"}\n', 2),
    ):
        (tmp_path / name).write_text(text)
        err = classify_fails(capsys, run, "--file", tmp_path / name, "--labels")
        assert err == f"error: {tmp_path / name} line {row}: {several}\n"
    (tmp_path / "own.csv").write_text("text,label\nwin a prize now,a;b\nlunch,c\n")
    assert read_inputs([], str(tmp_path / "own.csv"), None, None, True, ["a;b", "c"]).labels == ["a;b", "c"]
    multi = read_inputs([], str(tmp_path / "tagged.csv"), None, None, True, ["ham", "spam"], multi_label=True)
    assert multi.labels == ["spam", "ham;spam"]  # a --multi-label run reads the same file's sets
    unknown = "label 'ham;spamm' is not one of this classifier's labels (ham, spam)"
    (tmp_path / "typo.csv").write_text("text,label\nwin a prize now,ham;spamm\n")
    assert unknown in classify_fails(capsys, run, "--file", tmp_path / "typo.csv", "--labels")


def test_an_existing_output_is_refused_and_left_untouched_unless_overwrite(run, tmp_path, capsys):
    target = tmp_path / "scored.csv"
    target.write_text("my earlier results\n")
    assert "--overwrite" in classify_fails(capsys, run, "hello", "--output", target)
    assert target.read_text() == "my earlier results\n"
    classify_ok(capsys, run, "hello", "--output", target, "--overwrite")
    assert [r["text"] for r in read_rows(target)] == ["hello"]


@pytest.mark.slow
def test_jsonl_input_with_labels_and_empty_texts_left_out_with_a_count(run, small_csv, tmp_path, capsys):
    with open(small_csv, newline="") as f:
        rows = list(csv.DictReader(f))[::12]
    data = tmp_path / "new.jsonl"
    lines = [json.dumps({"Text": r["message"], "category": r["category"]}) for r in rows]
    data.write_text("\n".join([*lines, '{"Text": " ", "category": "ham"}', "[1, 2]"]) + "\n")
    report, err = classify_ok(capsys, run, "--file", data, "--labels", "--output", tmp_path / "scored.csv")
    assert "left out 2 input(s)" in err and f"line {len(rows) + 1}: empty text" in err
    scored = read_rows(tmp_path / "scored.csv")
    assert [r["Text"] for r in scored] == [r["message"] for r in rows]
    assert [r["category"] for r in scored] == [r["category"] for r in rows]
    assert re.search(rf"\(\d+ of {len(rows)}\)", report)
    as_arguments, _ = classify_ok(capsys, run, *[r["message"] for r in rows])
    assert [line.split("\t")[0] for line in as_arguments.splitlines()] == [r["predicted"] for r in scored]


def test_a_txt_file_stays_one_text_per_line(run, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("first, with a comma\tand a tab\n\nsecond\n")
    out, err = classify_ok(capsys, run, "--file", notes)
    assert [line.split("\t", 2)[2] for line in out.splitlines()] == ["first, with a comma and a tab", "second"]
    assert "notes.txt line 2: empty text" in err


@pytest.mark.slow
def test_each_text_is_printed_as_its_start_on_one_line(run, tmp_path, capsys):
    """A 23 KB text printed whole after its label buried every other line: the line shows its first characters,
    newlines as spaces, and an ellipsis where it was cut (--output keeps the whole text)."""
    letter = "Dear customer,\nyou have WON a prize.\n\n" + "Call 0800 now! " * 1600  # 24 KB over many lines
    data = tmp_path / "mail.csv"
    with data.open("w", newline="") as f:
        csv.writer(f).writerows([["text"], [letter], ["see you at lunch"]])
    out, _ = classify_ok(capsys, run, "--file", data)
    first, second = out.splitlines()
    label, _, text = first.split("\t")
    assert label in ("ham", "spam") and len(text) == classify.ECHO_CHARS == 72 and text.endswith("…")
    assert text.startswith("Dear customer, you have WON a prize. Call 0800 now! Call 0800 now!")
    assert second.endswith("\tsee you at lunch")
    classify_ok(capsys, run, "--file", data, "--output", tmp_path / "scored.csv")
    assert read_rows(tmp_path / "scored.csv")[0]["text"] == letter


def test_a_run_folder_and_a_model_folder_each_name_their_flag(run, small_csv, tmp_path, monkeypatch, capsys):
    """`--model runs/latest` said "no config.json at runs/latest/config.json"; `--checkpoint runs/lastest` (misspelt)
    said which file was missing from a folder that is not there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "latest").symlink_to(run, target_is_directory=True)
    (tmp_path / "weights" / "base").mkdir(parents=True)
    (tmp_path / "weights" / "base" / "config.json").write_text("{}")
    run_folder = "error: runs/latest is a fine-tuning run's folder (it holds classifier.json or .llama_scratch-run), "
    run_folder += "not a model checkpoint: a run is read by `classify --checkpoint runs/latest`"
    for main, argv, status in (
        (generate.main, ["--model", "runs/latest", "hello"], 1),
        (finetune_classifier.main, ["--model", "runs/latest", "--plan"], 2),
        (finetune_classifier.main, ["--model", "runs/latest", "--data", str(small_csv), "--max-steps", "1"], 2),
    ):
        assert main(argv) == status
        err = capsys.readouterr().err
        assert run_folder in err and err.count("error: ") == 1 and err.endswith("`)\n"), err
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["latest"]  # no run was started
    assert classify_fails(capsys, "runs/lastest", "hello") == "error: --checkpoint runs/lastest: no such directory\n"
    assert export_hf.main(["--checkpoint", "runs/lastest", "--output", "exported"]) == 2
    assert capsys.readouterr().err == "error: --checkpoint runs/lastest: no such directory\n"
    err = classify_fails(capsys, "weights/base", "hello")
    assert err.startswith("error: --checkpoint weights/base is a model checkpoint, not a fine-tuning run's folder")


def test_bad_inputs_are_one_line_before_the_model_loads(run, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(classify, "load_classifier", lambda *a, **k: pytest.fail("the model was loaded"))
    utf16 = tmp_path / "utf16.csv"
    utf16.write_bytes("text,label\nhi,ham\n".encode("utf-16"))
    headerless = tmp_path / "three.csv"
    headerless.write_text("a,b,c\nd,e,f\n")
    (tmp_path / "x.json").write_text("{}")
    for argv, expected in (
        (["--file", tmp_path / "missing.csv"], "No such file"),
        (["--file", tmp_path / "x.json"], ".jsonl"),
        (["--file", utf16], "UTF-16"),
        (["--file", headerless], "--text-column"),
        (["--file", headerless, "--text-column", "7"], "0-based"),
        (["--file", headerless, "--labels", "--text-column", "0"], "--label-column"),
        (["hello", "--output", tmp_path], "is a directory"),
    ):
        assert expected in classify_fails(capsys, run, *argv)


def test_columns_and_labels_are_found_as_in_training():
    names = ["0", "1"]
    assert known_label(" 01 ", names) == "1" and known_label("+0", names) == "0" and known_label("2", names) is None
    assert known_label("spam", ["ham", "spam"]) == "spam" and known_label("Spam", ["ham", "spam"]) is None
    no_header = [(1, ["great film", "1"]), (2, ["dull", "0"])]
    found = choose_columns(no_header, "f", None, None, True, names)  # label: the column of only label names
    assert (found.body, found.width, found.text, found.label) == (no_header, 2, 0, 1)
    header = [(1, ["id", " Review ", "stars"]), (2, ["7", "fine", "1"])]
    found = choose_columns(header, "f", None, "stars", True, names)
    assert (found.body, found.width, found.text, found.label) == (header[1:], 3, 1, 2) and not found.guessed
    found = choose_columns(header, "f", None, None, False, names)
    assert (found.text, found.label) == (1, None)
    texts = [(1, ["ok thanks"]), (2, ["see you at the station at eight"]), (3, ["running late, sorry"])]
    assert choose_columns(texts, "f", None, None, False, names).body == texts  # one column: a header only by name
    one_spam = [(1, ["WIN CASH NOW", "spam"]), *((n, [f"see you at the station at {n}", "ham"]) for n in range(2, 9))]
    found = choose_columns(one_spam, "f", None, None, True, ["ham", "spam"])
    assert found.body == one_spam and not found.where.header  # a label name atop label names is a value, not a name


def sms_rows(small_csv) -> list[tuple[str, str]]:
    """(text, label) of the module's 96 SMS messages."""
    with open(small_csv, newline="") as f:
        return [(r["message"], r["category"]) for r in csv.DictReader(f)]


@pytest.mark.slow
def test_training_and_classify_read_a_csv_quoted_tsv_as_written(run, small_csv, tmp_path, capsys):
    """csv.writer(delimiter="\\t") quotes texts with a TAB, a quote or a line end; both commands unquote them."""
    rows = sms_rows(small_csv)
    for i, extra in ((0, '\tand a "tab"'), (1, "\nsecond line"), (50, '\r\n"crlf"'), (51, "\t")):
        rows[i] = (rows[i][0] + extra, rows[i][1])
    path = tmp_path / "quoted.tsv"
    with path.open("w", newline="") as f:
        csv.writer(f, delimiter="\t").writerows([("message", "category"), *rows])
    quoted = sum(any(c in text for c in '\t"\r\n') for text, _ in rows)
    assert quoted > 4 and b'\tand a ""tab"""\tham\r\n' in path.read_bytes()  # the writer's quoting, read back
    capsys.readouterr()
    assert finetune_classifier.main(args_for(path, tmp_path / "tsv_run", "--max-steps", "1")) == 0
    log = capsys.readouterr().out
    read = f"text 'message', label 'category' (header row); {quoted} quoted fields read as csv quoting"
    assert f"{path}: 96 rows; ham 48, spam 48; 0 bad rows skipped; {read}" in log
    assert load_dataset(path).texts == [text for text, _ in rows]  # what that log line describes
    scored_csv = tmp_path / "scored.csv"
    _, err = classify_ok(capsys, run, "--file", path, "--labels", "--output", scored_csv)
    assert f"note: {path}: {quoted} quoted fields read as csv quoting" in err
    assert [(r["message"], r["category"]) for r in read_rows(scored_csv)] == rows


@pytest.mark.slow
def test_a_csv_of_unusual_column_names_is_read_alike_by_training_and_classify(run, small_csv, tmp_path, capsys):
    """`ref`, `sms_body` and `verdict`: no name either command knows, so both find the header row and the columns
    by their cells (the ids set aside, the longest values the text, few distinct values the label), say so in the
    same words, and read the same texts and labels. --no-header is classify's way out, as training's."""
    rows = sms_rows(small_csv)
    path = tmp_path / "unusual.csv"
    with path.open("w", newline="") as f:
        csv.writer(f).writerows(
            [("ref", "sms_body", "verdict"), *((f"r{1000 + i}", t, y) for i, (t, y) in enumerate(rows))]
        )
    read = "text 'sms_body', label 'verdict' (header row)"
    capsys.readouterr()
    assert finetune_classifier.main(args_for(path, tmp_path / "unusual_run", "--max-steps", "1")) == 0
    assert f"{path}: 96 rows; ham 48, spam 48; 0 bad rows skipped; {read}" in capsys.readouterr().out
    assert load_dataset(path).texts == [text for text, _ in rows]
    scored = tmp_path / "scored.csv"
    _, err = classify_ok(capsys, run, "--file", path, "--labels", "--output", scored)
    assert f"note: {path}: {read}\n" in err
    assert [(r["sms_body"], r["verdict"]) for r in read_rows(scored)] == rows
    _, err = classify_ok(capsys, run, "--file", path, "--output", scored, "--overwrite")  # the text column alone
    assert f"note: {path}: text 'sms_body' (header row)\n" in err
    assert [r["sms_body"] for r in read_rows(scored)] == [text for text, _ in rows]
    err = classify_fails(capsys, run, "--file", path, "--labels", "--no-header")  # the header row read as data
    assert f"{path} line 1: label 'verdict' is not one of this classifier's labels" in err


def test_classify_keeps_stray_quotes_of_a_tsv_and_says_so(run, tmp_path, capsys):
    path = tmp_path / "stray.tsv"
    path.write_text('text\tlabel\n"Are you coming down later?"\tham\n"Hey babe, call me\tham\n')
    _, err = classify_ok(capsys, run, "--file", path, "--labels", "--output", tmp_path / "scored.csv")
    assert f"note: {path}: quotes kept as written (line 3 is not csv quoting)" in err
    texts = ['"Are you coming down later?"', '"Hey babe, call me']
    assert [r["text"] for r in read_rows(tmp_path / "scored.csv")] == texts


@pytest.mark.slow
def test_jsonl_keys_of_other_names_are_found_by_their_values_in_training_and_classify(run, small_csv, tmp_path, capsys):
    """`docstring` holds the long strings and `package` few names: no column flags needed, and the log says which."""
    rows = sms_rows(small_csv)
    path = tmp_path / "code.jsonl"
    lines = [json.dumps({"docstring": text, "package": {"ham": "numpy", "spam": "requests"}[y]}) for text, y in rows]
    path.write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert finetune_classifier.main(args_for(path, tmp_path / "jsonl_run", "--max-steps", "1")) == 0
    log = capsys.readouterr().out
    assert (
        f"{path}: 96 rows; numpy 48, requests 48; 0 bad rows skipped; text 'docstring', label 'package' (JSON keys)"
        in log
    )
    classify_ok(capsys, run, "--file", path, "--output", tmp_path / "scored.csv")  # no --text-column needed
    assert [r["docstring"] for r in read_rows(tmp_path / "scored.csv")] == [text for text, _ in rows]


@pytest.mark.slow
def test_scored_files_keep_every_input_column_for_csv_tsv_and_jsonl(run, small_csv, tmp_path, capsys):
    """An `id` column (and any other) comes back beside the scores, in the input's order and format; the scores
    are those classify prints for the same texts."""
    rows = sms_rows(small_csv)[::8]
    printed, _ = classify_ok(capsys, run, *[text for text, _ in rows])
    expected = [line.split("\t")[0] for line in printed.splitlines()]
    table = [("id", "message", "source"), *((f"sms-{i}", text, "uci") for i, (text, _) in enumerate(rows))]
    for name, delimiter in (("in.csv", ","), ("in.tsv", "\t")):
        path, scored = tmp_path / name, tmp_path / f"out{Path(name).suffix}"
        with path.open("w", newline="") as f:
            csv.writer(f, delimiter=delimiter).writerows(table)
        classify_ok(capsys, run, "--file", path, "--output", scored)
        with scored.open(newline="", encoding="utf-8") as f:
            out = list(csv.DictReader(f, delimiter=delimiter))
        assert list(out[0]) == ["id", "message", "source", "predicted", "probability", "p_ham", "p_spam"]
        assert [(r["id"], r["message"], r["source"]) for r in out] == table[1:]
        assert [r["predicted"] for r in out] == expected
    path, scored = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    objects = [{"id": i, "text": text, "meta": {"lang": "en"}, "gold": y} for i, (text, y) in enumerate(rows)]
    path.write_text("".join(json.dumps(obj) + "\n" for obj in objects))
    classify_ok(capsys, run, "--file", path, "--output", scored)
    out = [json.loads(line) for line in scored.read_text().splitlines()]
    assert [{k: r[k] for k in ("id", "text", "meta", "gold")} for r in out] == objects  # every key, JSON types kept
    assert list(out[0])[4:] == ["predicted", "probability", "p_ham", "p_spam"]
    assert [r["predicted"] for r in out] == expected
    assert all(r["probability"] == max(r["p_ham"], r["p_spam"]) for r in out)


def test_the_input_is_never_overwritten_and_a_scored_file_is_not_scored_twice(run, tmp_path, capsys):
    data = tmp_path / "in.csv"
    data.write_text("id,text\n1,hello there\n2,win a prize\n")
    before = data.read_bytes()
    err = classify_fails(capsys, run, "--file", data, "--output", data, "--overwrite")
    assert "is the --file being classified" in err and data.read_bytes() == before
    scored = tmp_path / "scored.csv"
    classify_ok(capsys, run, "--file", data, "--output", scored)
    err = classify_fails(capsys, run, "--file", scored, "--output", tmp_path / "again.csv")
    assert "already" in err and "'predicted'" in err and not (tmp_path / "again.csv").exists()


def test_a_headerless_table_and_command_line_texts_are_scored_in_the_table_s_columns(tmp_path):
    """No model needed: what data/scored.py writes for a table without a header (columns named by number) and a
    command-line text beside it (its text in the text column, the other cells empty)."""
    from llama_scratch.data.inputs import read_inputs
    from llama_scratch.data.scored import scored_text

    data = tmp_path / "bare.csv"
    data.write_text("7,hello there,x\n8,win a prize now,y\n")
    inputs = read_inputs(["typed"], str(data), "1", None, False, ["ham", "spam"], header=False)
    assert inputs.texts == ["typed", "hello there", "win a prize now"]
    probs = [[0.25, 0.75], [0.5, 0.5], [0.875, 0.125]]
    text = scored_text(tmp_path / "out.csv", inputs, probs, [1, 0, 0], ["ham", "spam"])
    assert text.splitlines() == [
        "column_0,column_1,column_2,predicted,probability,p_ham,p_spam",
        ",typed,,spam,0.750000,0.250000,0.750000",
        "7,hello there,x,ham,0.500000,0.500000,0.500000",
        "8,win a prize now,y,ham,0.875000,0.875000,0.125000",
    ]
    as_json = scored_text(tmp_path / "out.jsonl", inputs, probs, [1, 0, 0], ["ham", "spam"]).splitlines()
    cells = {"column_0": "7", "column_1": "hello there", "column_2": "x"}
    assert json.loads(as_json[1]) == {**cells, "predicted": "ham", "probability": 0.5, "p_ham": 0.5, "p_spam": 0.5}
