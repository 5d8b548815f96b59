"""What the data flags of `python -m llama_scratch.finetune_classifier` read: --data cut into train, validation and
test splits, or joined by --val-data and --test-data, and what a run records of where each split came from (for
--resume's identity, metrics.json and classifier.json); and the splits as token ids (`tokenize`). The flags
themselves are finetune_settings' `DataSettings`."""

from __future__ import annotations

from .data.batching import TokenizedSplit, default_max_length, encode_texts
from .data.labelled import DataError, LabelledTexts, load_dataset
from .data.splitting import default_protocol, split_with_files
from .finetune_settings import DataSettings
from .model.tokenizer import Tokenizer
from .training.evaluation import check_threshold_value


def held_out_files(asked: DataSettings) -> dict[str, str]:
    """The splits given as files of their own ("val", "test"), by --val-data and --test-data."""
    return {name: path for name in ("val", "test") if (path := getattr(asked, f"{name}_data", None))}


def split_protocol(asked: DataSettings) -> str | None:
    """How --data is cut: --split, else the default for it; None with both --val-data and --test-data, when
    --data is all training (a --split then would cut nothing, so it is refused rather than ignored)."""
    if len(held_out_files(asked)) == 2:
        if asked.split:
            raise DataError("--split cuts --data, but with --val-data and --test-data every row of --data trains")
        return None
    return asked.split or default_protocol(asked.source)


def held_out_identity(asked: DataSettings, parts: dict[str, LabelledTexts]) -> dict:
    """What a resume point records of --val-data and --test-data: the file and a digest of what was read from it,
    so a resume with another file, or the same file edited, is refused (None: the split was cut from --data)."""
    files = held_out_files(asked)
    return {
        **{f"{k}_data": files.get(k) for k in ("val", "test")},
        **{f"{k}_digest": parts[k].fingerprint() if k in files else None for k in ("val", "test")},
    }


def split_files(asked: DataSettings, data: LabelledTexts, parts: dict[str, LabelledTexts]) -> dict:
    """Where each split came from, for metrics.json and classifier.json: the file (or dataset) read and a digest
    of what was read from it (`LabelledTexts.fingerprint`: --data's whole, for the splits cut from it)."""
    files = held_out_files(asked)
    whole = data.fingerprint()
    return {
        k: {"file": files[k], "digest": parts[k].fingerprint()}
        if k in files
        else {"file": asked.source, "digest": whole}
        for k in ("train", "val", "test")
    }


def read_data(asked: DataSettings, seed: int, log) -> tuple[LabelledTexts, dict[str, LabelledTexts], str | None]:
    """The labelled texts and their train/val/test split: cut from --data, or read from --val-data/--test-data
    (the protocol None when both are: nothing is cut)."""
    check_threshold(asked)
    columns = {"text_column": asked.text_column, "label_column": asked.label_column, "header": asked.header}
    data = load_dataset(asked.source, **columns, split=asked.data_split, multi_label=asked.multi_label)
    log(data.describe())
    protocol = split_protocol(asked)
    parts = split_with_files(data, protocol, seed, held_out_files(asked), columns, log)
    return data, parts, protocol


def check_threshold(asked: DataSettings) -> None:
    """--threshold decides each label of --multi-label, a probability strictly between 0 and 1 (at 0 or 1 every
    label, or none, would be predicted whatever the text); one label per text is the most probable class."""
    if asked.threshold is None:
        return
    if not asked.multi_label:
        raise ValueError("--threshold decides each label of --multi-label; one label per text takes the likeliest")
    check_threshold_value(asked.threshold)


def tokenize(
    parts: dict[str, LabelledTexts], tokenizer: Tokenizer, context: int, max_length: int | None, log
) -> tuple[dict[str, TokenizedSplit], int]:
    """Token ids per split. Training texts are cut to `max_length` (default: the longest training text, within the
    context); validation and test texts only to the model's context, as `classify` reads a file, so the figures a
    run reports are the ones classify gives on the same texts (a long test text is not judged by its start)."""
    ids = {k: encode_texts(v.texts, tokenizer)[0] for k, v in parts.items()}
    max_length = max_length or default_max_length(ids["train"], context)
    limit = {k: max_length if k == "train" else context for k in parts}
    cut = {k: sum(len(x) > limit[k] for x in ids[k]) for k in parts}
    beyond = sum(cut.values()) - cut["train"]  # validation and test texts longer than the model's context
    whole = "validation and test texts are evaluated whole, as classify reads them"
    more = f"; {beyond:,} longer than the model's context, cut to its {context:,} tokens" if beyond else ""
    log(f"max length {max_length} tokens; {cut['train']:,} training texts truncated ({whole}{more})")
    return {
        k: TokenizedSplit([x[: limit[k]] for x in ids[k]], parts[k].targets(), pad_id=tokenizer.pad_id) for k in parts
    }, max_length
