"""The tokenizer of an export, as the files transformers' `AutoTokenizer` reads with no code of ours.

The export carries the tokenizer the run trained with, read from the same file: a base checkpoint's
`tokenizer.json` is copied; a tiktoken vocabulary (the Llama-3 `tokenizer.model` in llama-models, or a
checkpoint's own) is written out as a `tokenizer.json`, its merges derived from the ranks as transformers'
`TikTokenConverter` derives them (no network, no transformers needed to export). Either way `tokenizer_config.json`
names our padding token and pads on the right, as training did, and sets `split_special_tokens`: our tokenizer
encodes a special token's spelling inside a text ("<|eot_id|>") as plain text, and so then does transformers', so
the padding token can never appear inside a text, where transformers' pooling would take it for padding.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..model.bpe import PRE_TOKENIZERS, byte_level_bpe_json, token_spelling
from ..model.tokenizer import Tokenizer, default_model_path, read_tiktoken_bpe

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def tokenizer_file(recorded: str, base: str | None) -> Path:
    """The file the run's tokenizer was read from (`recorded`: the run record's "tokenizer"), found as
    `classify.load_classifier` finds it: the llama-models Llama-3 vocabulary, else the checkpoint's tokenizer.model,
    original/tokenizer.model or tokenizer.json."""
    if recorded == "llama3":
        return default_model_path()
    where = Path(base) if base and Path(base).is_dir() else Path(recorded)  # where it is now, if it moved
    if where.is_file():
        return where
    for candidate in (where / "tokenizer.model", where / "original" / "tokenizer.model", where / "tokenizer.json"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"no tokenizer in {where} (the run's tokenizer {recorded}); pass --model")


def tokenizer_files(source: Path, tokenizer: Tokenizer, max_length: int) -> dict[str, str]:
    """File name -> text of `tokenizer.json` and `tokenizer_config.json` for `tokenizer`, read from `source`."""
    if source.suffix == ".json":
        tokenizer_json = json.loads(source.read_text(encoding="utf-8"))
        beside = source.with_name("tokenizer_config.json")
        config = json.loads(beside.read_text(encoding="utf-8")) if beside.is_file() else {}
        config.pop("added_tokens_decoder", None)  # transformers rebuilds it from tokenizer.json
        config.pop("chat_template", None)  # training saw plain texts; with split_special_tokens a chat would not work
        if tokenizer_json.get("post_processor") is None:  # transformers < 5 ignores add_bos_token here
            tokenizer_json["post_processor"] = bos_template(tokenizer)
    else:
        tokenizer_json, config = tiktoken_json(source, tokenizer), {"tokenizer_class": "PreTrainedTokenizerFast"}
    names = {t["id"]: t["content"] for t in tokenizer_json.get("added_tokens", [])}
    for key, token_id in (
        ("bos_token", tokenizer.bos_id),
        ("eos_token", tokenizer.eos_id),
        ("pad_token", tokenizer.pad_id),
    ):
        if token_id is not None and token_id not in names:
            raise ValueError(f"{source}: our {key} (id {token_id}) is not one of its added tokens")
        if token_id is not None:
            config[key] = names[token_id]
    config.update(
        add_bos_token=tokenizer.bos_id is not None,
        add_eos_token=False,
        padding_side="right",
        split_special_tokens=True,
        clean_up_tokenization_spaces=False,
    )
    config.setdefault("model_max_length", max_length)
    return {
        "tokenizer.json": json.dumps(tokenizer_json, ensure_ascii=False),
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n",
    }


def tiktoken_json(model_file: Path, tokenizer: Tokenizer) -> dict:
    """A `tokenizer.json` for a Llama-3 tiktoken vocabulary: byte-level BPE over the Llama-3 split pattern, every
    special token added, and the begin-of-text token put in front of each text when the tokenizer adds one."""
    ranks = read_tiktoken_bpe(model_file)
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    by_id = sorted(tokenizer.special_tokens.items(), key=lambda item: item[1])
    added = [{"id": i, "content": name, **flags} for name, i in by_id]
    return byte_level_bpe_json(
        added_tokens=added,
        pre_tokenizer=PRE_TOKENIZERS["llama-bpe"],
        vocab={token_spelling(token): rank for token, rank in ranks.items()},
        merges=[[token_spelling(left), token_spelling(right)] for left, right in merges_from_ranks(ranks)],
        ignore_merges=True,  # a piece that is a token is that token, as in tiktoken
        post_processor=bos_template(tokenizer),
    )


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """BPE merges from tiktoken ranks: each token of two or more bytes is every split of it into two tokens, in
    the order of the token's rank (then of the parts' ranks), as transformers' TikTokenConverter orders them."""
    merges = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges += [(rank, ranks[left], ranks[right], left, right) for left, right in splits]
    merges.sort(key=lambda m: m[:3])
    return [(left, right) for *_, left, right in merges]


def bos_template(tokenizer: Tokenizer) -> dict | None:
    """The post-processor that puts the begin-of-text token first (transformers >= 5 also honours add_bos_token;
    older versions read only this)."""
    if tokenizer.bos_id is None:
        return None
    name = next(n for n, i in tokenizer.special_tokens.items() if i == tokenizer.bos_id)
    first, second = ({"SpecialToken": {"id": name, "type_id": k}} for k in (0, 1))
    return {
        "type": "TemplateProcessing",
        "single": [first, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [first, {"Sequence": {"id": "A", "type_id": 0}}, second, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {name: {"id": name, "ids": [tokenizer.bos_id], "tokens": [name]}},
    }
