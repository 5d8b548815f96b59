import csv
import io
import json
from importlib import resources

import pytest
import torch

from llama_scratch.data.labelled import MAX_CLASSES, DataError, DataWarning, LabelledTexts, load_dataset, load_sms_spam
from llama_scratch.data.splitting import shared_texts, split_dataset


def as_csv(rows, **dialect):
    out = io.StringIO()
    csv.writer(out, **{"lineterminator": "\n", **dialect}).writerows(rows)
    return out.getvalue()


def write(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return path


@pytest.fixture(scope="module")
def sms():
    return load_sms_spam()


# ---------------------------------------------------------------------------------------------- SMS


def test_sms_spam_is_read_exactly(sms):
    assert len(sms) == 5574 and sms.class_counts() == {"ham": 4827, "spam": 747}
    assert sms.label_names == ["ham", "spam"] and sms.skipped == [] and sms.source == "sms_spam"
    raw = resources.files("llama_scratch").joinpath("data/sms_spam.tsv").read_bytes().decode("utf-8")
    lines = raw.split("\n")
    assert lines[-1] == "" and len(lines) == 5575
    rebuilt = [f"{sms.label_names[y]}\t{t}" for y, t in zip(sms.labels, sms.texts, strict=True)]
    assert rebuilt == lines[:-1] and sms.rows == list(range(1, 5575))


def test_sms_leading_quotes_and_c1_characters_are_kept(sms):
    assert sum(t.startswith('"') for t in sms.texts) == 54
    assert sms.texts[282].startswith('"Wen u miss someone, the person is definitely special')
    assert sum(any("\x91" <= c <= "\x97" for c in t) for t in sms.texts) == 35
    assert sms.texts[18] == "Fine if that\x92s the way u feel. That\x92s the way its gota b"


def test_sms_by_name_and_as_a_file_agree(sms):
    assert load_dataset("sms_spam").texts == sms.texts
    as_file = load_dataset(resources.files("llama_scratch").joinpath("data/sms_spam.tsv"))  # headerless TSV
    assert as_file.texts == sms.texts and as_file.labels == sms.labels
    assert as_file.fingerprint() == sms.fingerprint()  # its stray quotes are not csv quoting: every one is kept
    assert as_file.describe().endswith("; quotes kept as written (line 54 is not csv quoting)")


# ---------------------------------------------------------------------------------------------- splits


def test_book_split_sizes_disjoint_balanced_deterministic(sms):
    parts = split_dataset(sms, "book", seed=123)
    assert [len(parts[k]) for k in ("train", "val", "test")] == [1045, 149, 300]
    rows = [set(parts[k].rows) for k in ("train", "val", "test")]
    assert not (rows[0] & rows[1] or rows[0] & rows[2] or rows[1] & rows[2])
    total = sum((torch.bincount(torch.tensor(p.labels), minlength=2) for p in parts.values()), torch.zeros(2))
    assert total.tolist() == [747, 747]  # every spam kept, ham undersampled to match
    assert split_dataset(sms, "book", seed=123)["test"].rows == parts["test"].rows
    assert split_dataset(sms, "book", seed=7)["test"].rows != parts["test"].rows


def test_dedup_split_keeps_duplicates_on_one_side(sms):
    book = split_dataset(sms, "book")
    assert shared_texts(book["train"], book["test"]) > 0  # why "dedup" exists
    dedup = split_dataset(sms, "dedup")
    assert [len(dedup[k]) for k in ("train", "val", "test")] == [898, 128, 258]
    assert shared_texts(dedup["train"], dedup["test"]) == 0
    assert shared_texts(dedup["train"], dedup["val"]) == shared_texts(dedup["val"], dedup["test"]) == 0
    assert not {t.casefold() for t in dedup["train"].texts} & {t.casefold() for t in dedup["test"].texts}


def test_stratified_and_full_keep_every_row(sms):
    for protocol in ("stratified", "full"):
        parts = split_dataset(sms, protocol)
        assert [len(parts[k]) for k in ("train", "val", "test")] == [3901, 557, 1116]
        assert sorted(r for p in parts.values() for r in p.rows) == sms.rows
    strat = split_dataset(sms, "stratified")
    assert [strat[k].class_counts()["spam"] for k in ("train", "val", "test")] == [523, 74, 150]
    assert strat["train"].labels[:50] != sorted(strat["train"].labels[:50])  # classes are mixed, not blocks


def test_split_errors():
    tiny = LabelledTexts(["a", "b", "c", "d"], [0, 1, 0, 1], ["x", "y"], "tiny")
    with pytest.raises(DataError, match="tiny"):
        split_dataset(tiny, "full")
    with pytest.raises(ValueError, match="stratified"):
        split_dataset(tiny, "random")


# ---------------------------------------------------------------------------------------------- user files


def test_csv_with_header_quotes_bom_and_crlf(tmp_path):
    body = 'id,Text,label\r\n1,"hello, world",pos\r\n2,"two\r\nlines",neg\r\n3,"say ""hi""",pos\r\n\r\n'
    data = load_dataset(write(tmp_path, "d.csv", b"\xef\xbb\xbf" + body.encode()))
    assert data.texts == ["hello, world", "two\r\nlines", 'say "hi"']
    assert data.labels == [1, 0, 1] and data.label_names == ["neg", "pos"] and data.rows == [2, 3, 5]


def test_csv_named_columns(tmp_path):
    path = write(tmp_path, "d.csv", "body,kind,note\nfoo,a,x\nbar,b,y\n")
    with pytest.raises(DataError, match="--text-column"):
        load_dataset(path)
    data = load_dataset(path, text_column="body", label_column="kind")
    assert data.texts == ["foo", "bar"] and data.label_names == ["a", "b"]
    with pytest.raises(DataError, match="'missing'"):
        load_dataset(path, text_column="missing", label_column="kind")


def test_headerless_tsv_finds_the_label_column(tmp_path):
    rows = [f"message number {i}\t{'spam' if i % 3 else 'ham'}" for i in range(12)]
    data = load_dataset(write(tmp_path, "d.tsv", "\n".join(rows) + "\n"))
    assert len(data) == 12 and data.texts[0] == "message number 0" and data.label_names == ["ham", "spam"]
    flipped = load_dataset(write(tmp_path, "e.tsv", "".join(f'{"ab"[i % 2]}\t"quoted {i}\n' for i in range(8))))
    assert flipped.texts[:2] == ['"quoted 0', '"quoted 1'] and flipped.label_names == ["a", "b"]


def test_tsv_written_by_pythons_csv_writer_reads_unquoted(tmp_path):
    """csv.writer(delimiter="\\t") quotes a field with a TAB, a quote or a line end; the text is what went in."""
    rows = [("text", "label"), ('say "hi"', "a"), ("a\ttab", "b"), ("two\nlines", "a"), ('"all quoted"', "b")]
    rows += [("plain", "a"), ("crlf\r\ninside", "b")]
    body = as_csv(rows, delimiter="\t", lineterminator="\r\n")
    assert '"say ""hi"""\ta\r\n' in body  # the writer's quoting, read back below
    for name in ("d.tsv", "d.txt"):
        data = load_dataset(write(tmp_path, name, body))
        assert data.texts == [t for t, _ in rows[1:]] and data.label_names == ["a", "b"]
        assert data.rows == [2, 3, 4, 6, 7, 8] and data.skipped == []  # a row's line is where it starts
        assert data.describe().endswith("text 'text', label 'label' (header row); 5 quoted fields read as csv quoting")
    every = load_dataset(write(tmp_path, "all.tsv", as_csv(rows, delimiter="\t", quoting=csv.QUOTE_ALL)))
    assert every.texts == [t for t, _ in rows[1:]] and every.label_names == ["a", "b"]


def test_tsv_with_stray_quotes_keeps_every_quote_and_says_where(tmp_path):
    """One quote that no csv writer would write means the file is not csv-quoted: no field is unquoted."""
    body = 'text\tlabel\n"quoted all"\ta\n"opened only\tb\nsaid "hi" twice\ta\n"x ""y"""\tb\n'
    data = load_dataset(write(tmp_path, "d.tsv", body))
    assert data.texts == ['"quoted all"', '"opened only', 'said "hi" twice', '"x ""y"""'] and data.rows == [2, 3, 4, 5]
    assert data.describe().endswith("; quotes kept as written (line 3 is not csv quoting)")
    assert "quotes" not in load_dataset(write(tmp_path, "n.tsv", "text\tlabel\nno quotes\ta\nat all\tb\n")).columns


def test_ambiguous_headerless_file_asks_for_columns(tmp_path):
    path = write(tmp_path, "d.csv", "a,x\nb,y\na,y\nb,x\n")
    with pytest.raises(DataError, match="--text-column") as err:
        load_dataset(path)
    assert "d.csv" in str(err.value)
    data = load_dataset(path, text_column="0", label_column="1")
    assert data.texts == ["a", "b", "a", "b"] and data.label_names == ["x", "y"]


def test_jsonl_keys_and_bad_lines(tmp_path):
    lines = [
        json.dumps({"text": "good one", "label": "pos"}),
        "{not json",
        json.dumps(["a", "list"]),
        json.dumps({"text": "no label"}),
        json.dumps({"text": 5, "label": "pos"}),
        json.dumps({"text": "bad", "label": 0.5}),
        json.dumps({"text": "second", "label": "neg"}),
    ]
    with pytest.warns(DataWarning, match="line 2: malformed JSON") as record:
        data = load_dataset(write(tmp_path, "d.jsonl", "\r\n".join(lines)))
    assert data.texts == ["good one", "second"] and data.rows == [1, 7]
    assert [b.line for b in data.skipped] == [2, 3, 4, 5, 6]
    assert "line 4: missing label" in str(record[0].message)
    assert load_dataset(
        write(tmp_path, "c.jsonl", '{"Text": "a", "Label": 1}\n{"Text": "b", "Label": 0}\n')
    ).labels == [1, 0]
    custom = write(tmp_path, "e.jsonl", '{"q": "x", "y": 1}\n{"q": "z", "y": 0}\n')
    assert load_dataset(custom, text_column="q", label_column="y").labels == [1, 0]
    assert data.columns == "text 'text', label 'label' (JSON keys)"


def test_jsonl_keys_of_other_names_are_told_apart_by_their_values(tmp_path):
    """`docstring` holds long strings, `package` a few names: the text and the label, as in a table's columns."""
    array = [f"Return the {w} of the array elements over the given axis." for w in ("sum", "mean", "max", "min")]
    http = [f"Send a {verb} request to the given URL and return the response." for verb in ("GET", "POST", "PUT")]
    docs = [*array, *http, "Return the indices that would sort the array.", "Close the session's connections."]
    packages = ["numpy"] * 4 + ["requests"] * 3 + ["numpy", "requests"]
    objects = [{"id": i, "docstring": d, "package": p} for i, (d, p) in enumerate(zip(docs, packages, strict=True))]
    path = write(tmp_path, "code.jsonl", "".join(json.dumps(o) + "\n" for o in objects))
    data = load_dataset(path)
    assert data.texts == docs and data.label_names == ["numpy", "requests"]
    assert data.labels == [int(p == "requests") for p in packages]
    assert data.describe().endswith("; text 'docstring', label 'package' (JSON keys)")
    assert load_dataset(path, text_column="docstring").labels == data.labels  # the other key still found
    pairs = write(tmp_path, "pairs.jsonl", "".join(json.dumps({"a": f"x{i}", "b": f"y{i}"}) + "\n" for i in range(6)))
    keys = r"\(keys \['a', 'b'\] on line 1\); pass --text-column and --label-column \(key names\)"
    with pytest.raises(DataError, match=r"pairs.jsonl: .*neither is clearly the label " + keys):
        load_dataset(pairs)


def test_integer_and_string_labels_sort_naturally(tmp_path):
    ints = load_dataset(write(tmp_path, "i.jsonl", "".join(f'{{"text": "t{n}", "label": {n}}}\n' for n in (10, 2, 1))))
    assert ints.label_names == ["1", "2", "10"] and ints.labels == [2, 1, 0]
    csv_ints = load_dataset(write(tmp_path, "i.csv", "text,label\na,2\nb,10\nc,02\n"))
    assert csv_ints.label_names == ["2", "10"] and csv_ints.labels == [0, 1, 0]
    strings = load_dataset(write(tmp_path, "s.csv", "text,label\na,zeta\nb,alpha\nc,Beta\n"))
    assert strings.label_names == ["Beta", "alpha", "zeta"] and strings.labels == [2, 1, 0]


def test_multi_class_book_split_balances_every_class(tmp_path):
    rows = "".join(f"text {i},{c}\n" for i, c in enumerate(["a"] * 40 + ["b"] * 25 + ["c"] * 10))
    data = load_dataset(write(tmp_path, "m.csv", "sentence,category\n" + rows))
    assert data.num_classes == 3 and data.class_counts() == {"a": 40, "b": 25, "c": 10}
    parts = split_dataset(data, "book")
    assert [len(parts[k]) for k in ("train", "val", "test")] == [21, 3, 6]
    assert sorted(y for p in parts.values() for y in p.labels) == [0] * 10 + [1] * 10 + [2] * 10


def test_bad_rows_are_reported_with_line_numbers(tmp_path):
    body = "text,label\nfine,a\n  ,a\nno label,\nthree,b,extra\nalso fine,b\n"
    with pytest.warns(DataWarning) as record:
        data = load_dataset(write(tmp_path, "d.csv", body))
    assert data.texts == ["fine", "also fine"]
    assert [(b.line, b.reason) for b in data.skipped] == [
        (3, "empty text"),
        (4, "missing label"),
        (5, "expected 2 columns, found 3"),
    ]
    message = str(record[0].message)
    assert "d.csv" in message and "line 3: empty text" in message and "line 5" in message


def test_undecodable_bytes_skip_only_their_row(tmp_path):
    path = write(tmp_path, "d.tsv", b"text\tlabel\ncaf\xe9\tham\nok\tham\nfine \xc2\xa3\tspam\n")
    with pytest.warns(DataWarning, match="line 2: undecodable bytes.*UTF-8"):
        data = load_dataset(path)
    assert data.texts == ["ok", "fine \u00a3"] and data.rows == [3, 4]


def test_unusable_files_name_the_file(tmp_path):
    with pytest.raises(DataError, match="nope.csv"):
        load_dataset(tmp_path / "nope.csv")
    with pytest.raises(DataError, match="empty.csv"):
        load_dataset(write(tmp_path, "empty.csv", ""))
    with pytest.raises(DataError, match="header.csv: no usable rows"):
        load_dataset(write(tmp_path, "header.csv", "text,label\n"))
    with pytest.raises(DataError, match="allbad.jsonl: no usable rows.*line 1: malformed"):
        load_dataset(write(tmp_path, "allbad.jsonl", "{\n[\n"))
    with pytest.raises(DataError, match=r"one.csv: only one class \('a'\)"):
        load_dataset(write(tmp_path, "one.csv", "text,label\nx,a\ny,a\n"))
    with pytest.raises(DataError, match="d.xlsx: unsupported"):
        load_dataset(write(tmp_path, "d.xlsx", b"PK\x03\x04\x14\x00\x00\x00\x08\x00"))  # a zip: NULs, not UTF-8


# ---------------------------------------------------------------------------------------------- hostile files


def test_too_many_classes_is_refused_at_load_time(tmp_path):
    """A text-like label column (one class per row) would allocate a num_classes² confusion matrix in training."""
    ids = write(tmp_path, "ids.csv", "text,label\n" + "".join(f"message {i},id{i}\n" for i in range(30)))
    with pytest.raises(DataError, match=r"ids.csv: 30 distinct labels in 30 rows.*wrong label column\? \(--label"):
        load_dataset(ids)
    rows = "".join(f"message {i},c{i % (MAX_CLASSES + 1)}\n" for i in range(2 * (MAX_CLASSES + 1)))
    with pytest.raises(DataError, match=f"capped.csv: {MAX_CLASSES + 1:,} distinct labels in {2 * MAX_CLASSES + 2:,}"):
        load_dataset(write(tmp_path, "capped.csv", "text,label\n" + rows))
    few = load_dataset(write(tmp_path, "few.csv", "text,label\n" + "".join(f"m {i},c{i}\n" for i in range(10))))
    assert few.num_classes == 10  # a tiny file may have one row per class
    half = load_dataset(write(tmp_path, "half.csv", "text,label\n" + "".join(f"m {i},c{i % 20}\n" for i in range(40))))
    assert half.num_classes == 20


def test_utf16_utf32_and_nul_bytes_are_refused(tmp_path):
    """Decoded as UTF-8 these load as 'valid' rows with labels like '\\x00h\\x00a\\x00m'."""
    body = "text\tlabel\nhello there\tham\nwin money\tspam\n"
    for codec in ("utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"):  # the four byte-order marks
        path = write(tmp_path, f"{codec}.tsv", ("\ufeff" + body).encode(codec))
        message = f"{codec}.tsv looks {codec[:6].upper()} encoded \\(byte-order mark\\); save it as UTF-8"
        with pytest.raises(DataError, match=message):
            load_dataset(path)
    no_bom = write(tmp_path, "le.csv", b"text,label\n" + "hello,ham\nwin,spam\n".encode("utf-16-le"))
    with pytest.raises(DataError, match=r"le.csv contains NUL bytes \(line 2\): is it binary, or UTF-16/32"):
        load_dataset(no_bom)
    long = "".join(f"message number {i}\t{'ab'[i % 2]}\n" for i in range(200))
    data = load_dataset(write(tmp_path, "one_nul.tsv", "text\tlabel\nnul \x00 here\ta\n" + long))
    assert data.texts[0] == "nul \x00 here" and len(data) == 201  # a stray NUL in a text file is kept, as before


def test_integer_labels_longer_than_18_digits_are_refused(tmp_path):
    """int() refuses over 4,300 digits with a bare ValueError; a label that long is a wrong column or a broken file."""
    body = "text,label\na,1\nb,2\nc," + "9" * 5000 + "\nd,1\n"
    with pytest.raises(DataError, match="long.csv line 4: the label is a 5,000-digit number.*--label-column"):
        load_dataset(write(tmp_path, "long.csv", body))
    with pytest.raises(DataError, match="id.csv line 2: the label is a 19-digit number"):
        load_dataset(write(tmp_path, "id.csv", "text,label\na,-1234567890123456789\nb,2\n"))
    assert load_dataset(write(tmp_path, "ok.csv", "text,label\na,+123456789012345678\nb,2\n")).label_names == [
        "2",
        "123456789012345678",
    ]
    lines = ['{"text": "a", "label": 1}', '{"text": "b", "label": ' + "7" * 5000 + "}"]
    with pytest.raises(DataError, match="long.jsonl line 2: a number of more than 4,300 digits"):
        load_dataset(write(tmp_path, "long.jsonl", "\n".join(lines)))
    lines[1] = '{"text": "b", "label": "' + "7" * 4000 + '"}'
    with pytest.raises(DataError, match="string.jsonl line 2: the label is a 4,000-digit number"):
        load_dataset(write(tmp_path, "string.jsonl", "\n".join(lines)))


def test_txt_files_are_read_as_tab_or_comma_separated(tmp_path):
    """UCI's sentiment sets ship as `sentence<TAB>label` lines in .txt files, with no header."""
    uci = "".join(f"A very, very good movie number {i}.  \t{i % 2}\n" for i in range(12))
    data = load_dataset(write(tmp_path, "imdb_labelled.txt", uci))
    assert len(data) == 12 and data.label_names == ["0", "1"] and data.labels[:2] == [0, 1]
    assert data.texts[0] == "A very, very good movie number 0.  "  # commas stay in the text
    sms_txt = write(tmp_path, "sms.txt", resources.files("llama_scratch").joinpath("data/sms_spam.tsv").read_bytes())
    assert load_dataset(sms_txt).texts == load_sms_spam().texts
    commas = load_dataset(write(tmp_path, "c.txt", 'text,label\n"good, really",pos\nbad,neg\n'))
    assert commas.texts == ["good, really", "bad"] and commas.label_names == ["neg", "pos"]
    ragged = "good movie\t1\nbad, bad\tmovie\t0\nno delimiter at all\n"
    with pytest.raises(
        DataError, match=r"r.txt: .* tab- or comma-separated .* first 3 lines \(0-2 tabs, 1-2 comma-separated fields\)"
    ):
        load_dataset(write(tmp_path, "r.txt", ragged))
    with pytest.raises(DataError, match="empty.txt: the file has no rows"):
        load_dataset(write(tmp_path, "empty.txt", "\n\n"))


# ---------------------------------------------------------------------------------------------- headers by content


def feedback(i):
    """A customer's comment, long enough that a column name above it stands out."""
    return f"order {i} arrived {'late and the box was crushed' if i % 2 else 'early and well packed, thanks'}"


def test_unnamed_header_is_found_by_content(tmp_path):
    """`rating` appears once atop a column of pos/neg: a name, not a third class."""
    rows = [[feedback(i), "neg" if i % 2 else "pos"] for i in range(60)]
    data = load_dataset(write(tmp_path, "f.csv", as_csv([["feedback", "rating"], *rows])))
    assert data.class_counts() == {"neg": 30, "pos": 30} and data.skipped == []
    assert data.texts == [r[0] for r in rows] and data.rows[0] == 2
    assert "text 'feedback', label 'rating' (header row)" in data.describe()


def test_three_columns_are_told_apart_by_content(tmp_path):
    """An id column (every value distinct) is never the text or the label, with or without a header row."""
    buckets = ["1-2", "3", "4-5"]
    rows = [[str(1000 + i), feedback(i), buckets[i % 3]] for i in range(60)]
    named = load_dataset(write(tmp_path, "n.csv", as_csv([["id", "customer_feedback", "stars_bucket"], *rows])))
    assert named.texts == [r[1] for r in rows] and named.label_names == buckets and named.rows[0] == 2
    assert "text 'customer_feedback', label 'stars_bucket' (header row)" in named.describe()
    bare = load_dataset(write(tmp_path, "b.csv", as_csv(rows)))
    assert bare.texts == named.texts and bare.labels == named.labels and bare.rows[0] == 1
    assert "text column 1, label column 2 (no header row)" in bare.describe()
    moved = load_dataset(write(tmp_path, "m.tsv", "".join(f"{r[2]}\t{r[0]}\t{r[1]}\n" for r in rows)))
    assert moved.texts == named.texts and moved.labels == named.labels


def test_ambiguous_columns_name_what_was_seen(tmp_path):
    few = [[str(i), feedback(i), "abc"[i % 3], "xy"[i % 2]] for i in range(40)]
    with pytest.raises(DataError, match=r"'product' and 'region'.*--label-column.*--no-header") as err:
        load_dataset(write(tmp_path, "few.csv", as_csv([["id", "comment", "product", "region"], *few])))
    assert "few.csv" in str(err.value)
    assert load_dataset(write(tmp_path, "few.csv", as_csv(few)), label_column="3").label_names == ["x", "y"]
    long = [[str(i), feedback(i), feedback(i + 1) + "!", "yn"[i % 2]] for i in range(40)]
    with pytest.raises(DataError, match=r"'question' and 'answer'.*--text-column"):
        load_dataset(write(tmp_path, "long.csv", as_csv([["ref", "question", "answer", "verdict"], *long])))
    with pytest.raises(DataError, match=r"columns 1 and 2 .*first row.*--text-column"):
        load_dataset(write(tmp_path, "bare.csv", as_csv(long)))


def test_header_can_be_forced_either_way(tmp_path):
    rows = [[feedback(i), "neg" if i % 2 else "pos"] for i in range(20)]
    path = write(tmp_path, "f.csv", as_csv([["feedback", "rating"], *rows]))
    kept = load_dataset(path, header=False)
    assert kept.texts[0] == "feedback" and kept.class_counts() == {"neg": 10, "pos": 10, "rating": 1}
    bare = write(tmp_path, "b.tsv", "".join(f"{t}\t{y}\n" for t, y in rows))
    assert len(load_dataset(bare)) == 20
    dropped = load_dataset(bare, header=True)
    assert dropped.texts == [r[0] for r in rows[1:]] and dropped.rows[0] == 2
    assert load_dataset(bare, header=True, text_column="0", label_column="1").texts == dropped.texts
