"""--data beyond text files: Parquet files, and Hugging Face dataset repositories (never fetched in these tests)."""

import builtins
from pathlib import Path

import pytest

from llama_scratch.data import hub as hub_data
from llama_scratch.data.labelled import DataError, load_dataset

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROWS = [("great film", "pos"), ("awful plot", "neg"), ("loved it", "pos"), ("boring", "neg"), ("fine acting", "pos")]


def write_parquet(path: Path, rows=ROWS, names=("sentence", "label")) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = {names[0]: [t for t, _ in rows], names[1]: [y for _, y in rows], "id": list(range(len(rows)))}
    pq.write_table(pa.table(columns), path)
    return path


def test_parquet_reads_like_the_same_csv(tmp_path):
    csv = tmp_path / "d.csv"
    csv.write_text("sentence,label\n" + "".join(f"{t},{y}\n" for t, y in ROWS), encoding="utf-8")
    from_csv = load_dataset(csv)
    from_parquet = load_dataset(write_parquet(tmp_path / "d.parquet"))
    assert (from_parquet.texts, from_parquet.labels) == (from_csv.texts, from_csv.labels)
    assert from_parquet.label_names == from_csv.label_names == ["neg", "pos"]
    assert from_parquet.rows == [1, 2, 3, 4, 5]
    assert "'sentence'" in from_parquet.columns and "'label'" in from_parquet.columns


def test_parquet_named_columns_and_integer_labels(tmp_path):
    rows = [(t, i % 2) for i, (t, _) in enumerate(ROWS)]
    path = write_parquet(tmp_path / "d.parquet", rows, names=("review", "stars"))
    data = load_dataset(path, text_column="review", label_column="stars")
    assert data.label_names == ["0", "1"] and data.labels == [0, 1, 0, 1, 0]


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "d.parquet")
    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(DataError, match=r"d\.parquet is a Parquet file, which needs pyarrow: pip install "):
        load_dataset(path)


def test_bad_parquet_is_one_error_naming_the_file(tmp_path):
    fake = tmp_path / "fake.parquet"
    fake.write_text("sentence,label\nhello,pos\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"fake\.parquet: unreadable Parquet file"):
        load_dataset(fake)
    path = write_parquet(tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d\.parquet: no column 'body'"):
        load_dataset(path, text_column="body")
    odd = write_parquet(tmp_path / "odd.parquet", names=("a", "b"))
    with pytest.raises(DataError, match=r"odd\.parquet: cannot tell the text and label columns"):
        load_dataset(odd)


def fake_hub(tmp_path, monkeypatch, layout: dict[str, list]) -> list:
    """snapshot_download replaced by one that writes `layout` (relative path -> rows) and records its calls."""
    calls = []

    def snapshot_download(repo_id, repo_type=None, allow_patterns=None, **kwargs):
        calls.append((repo_id, repo_type, allow_patterns))
        root = tmp_path / "hub" / repo_id.replace("/", "--")
        for name, rows in layout.items():
            if name.endswith(".parquet"):
                write_parquet(root / name, rows)
            else:
                (root / name).parent.mkdir(parents=True, exist_ok=True)
                (root / name).write_text("text,label\n" + "".join(f"{t},{y}\n" for t, y in rows), encoding="utf-8")
        return str(root)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("LLAMA_SCRATCH_OFFLINE", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hub_data, "snapshot_download", snapshot_download)
    return calls


def test_dataset_id_with_parquet_shards_and_split(tmp_path, monkeypatch):
    test_rows = [("meh", "neg"), ("superb", "pos"), ("dull", "neg")]
    calls = fake_hub(
        tmp_path,
        monkeypatch,
        {"data/train-00000-of-00001.parquet": ROWS, "data/test-00000-of-00001.parquet": test_rows},
    )
    train = load_dataset("someone/reviews")
    assert train.texts == [t for t, _ in ROWS] and train.source == "someone/reviews (train)"
    test = load_dataset("someone/reviews", split="test")
    assert test.texts == ["meh", "superb", "dull"] and test.labels == [0, 1, 0]
    assert calls[0][:2] == ("someone/reviews", "dataset") and "*.parquet" in calls[0][2]
    with pytest.raises(DataError, match=r"someone/reviews: no 'validation' split"):
        load_dataset("someone/reviews", split="validation")


def test_dataset_id_with_csv_layout(tmp_path, monkeypatch):
    fake_hub(tmp_path, monkeypatch, {"train.csv": ROWS, "test.csv": ROWS[:3]})
    assert load_dataset("someone/sms").texts == [t for t, _ in ROWS]
    assert len(load_dataset("someone/sms", split="test")) == 3


def test_offline_refuses_without_fetching(tmp_path, monkeypatch):
    calls = fake_hub(tmp_path, monkeypatch, {"train.csv": ROWS})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match=r"cannot fetch dataset someone/sms: offline \(HF_HUB_OFFLINE"):
        load_dataset("someone/sms")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("LLAMA_SCRATCH_OFFLINE", "1")
    with pytest.raises(DataError, match=r"offline \(LLAMA_SCRATCH_OFFLINE"):
        load_dataset("someone/sms")
    assert calls == []


def test_unreachable_hub_is_one_data_error(tmp_path, monkeypatch):
    fake_hub(tmp_path, monkeypatch, {})

    def unreachable(*args, **kwargs):
        raise OSError("Connection refused\nmore detail")

    monkeypatch.setattr(hub_data, "snapshot_download", unreachable)
    with pytest.raises(DataError, match=r"^cannot fetch dataset someone/sms: OSError: Connection refused; check"):
        load_dataset("someone/sms")


@pytest.mark.parametrize("ref", ["./nope/data", "nope/data/train.csv", "~/nope/data"])
def test_mistyped_local_path_is_no_such_file_never_a_fetch(tmp_path, monkeypatch, ref):
    calls = fake_hub(tmp_path, monkeypatch, {"train.csv": ROWS})
    with pytest.raises(DataError, match="no such file"):
        load_dataset(ref)
    assert calls == []
