"""GPT-2-style byte-level BPE vocabularies (SmolLM2, Llama-3 from GGUF or `tokenizer.json`) on tiktoken.

A byte-level BPE tokenizer is three things: a regex that cuts text into pieces, a vocabulary whose tokens are
byte strings, and the merge order. Hugging Face's `tokenizer.json` and GGUF metadata store the tokens spelled
in GPT-2's printable alphabet (each byte stands for one visible character, e.g. a space is "Ġ"); tiktoken wants
the raw bytes, with each token's id as its merge rank. This module translates between the two:

    GGUF metadata --hf_tokenizer_files--> tokenizer.json + tokenizer_config.json --parts_from_hf_json--> TokenizerParts

so a converted checkpoint is read the same way as one downloaded from the Hugging Face hub. `Tokenizer.from_hf_json`
turns the `TokenizerParts` into a `Tokenizer`: `tokenizer.py` imports this module, never the other way round.
"""

from __future__ import annotations

import functools
import json
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import tiktoken

# The pre-tokenizer regexes, written for tiktoken (Rust `fancy-regex`).
# Llama-3: text is first cut into pieces (words with their leading space, numbers of at most three digits, runs of
# punctuation, newlines, spaces) and BPE merges happen only inside a piece.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-2: contractions, letters and numbers with an optional leading space, punctuation runs, spaces.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# SmolLM: first every digit is cut out on its own, then the GPT-2 regex runs on the text between digits. As one
# regex: a digit is a piece, no other piece contains one, and a digit ends a space run the way the end of the
# text would (`\s+(?!\S)` becomes `\s+(?![^\s\p{N}])`).
SMOLLM_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d|\p{N}| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"

# llama.cpp's `tokenizer.ggml.pre` names -> the Hugging Face pre-tokenizer that reproduces them.
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_NO_REGEX = {**_BYTE_LEVEL, "use_regex": False}
_LLAMA3_NAMES = ("llama-bpe", "llama3", "llama-v3")
PRE_TOKENIZERS: dict[str, dict] = {
    "gpt-2": _BYTE_LEVEL,
    "smollm": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
    **{
        name: {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
                _NO_REGEX,
            ],
        }
        for name in _LLAMA3_NAMES
    },
}

# llama.cpp token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@functools.cache
def byte_to_char() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves, the other 68
    (controls, space, ...) are moved to code points 256 and up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


@functools.cache
def char_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_char().items()}


def token_bytes(token: str) -> bytes:
    """The raw bytes a vocabulary entry spelled in GPT-2's alphabet stands for ("Ġthe" -> b" the")."""
    try:
        return bytes(char_to_byte()[c] for c in token)
    except KeyError:
        # A few vocabularies carry entries outside the alphabet; like transformers, take them as UTF-8 text.
        return token.encode("utf-8")


def token_spelling(raw: bytes) -> str:
    return "".join(byte_to_char()[b] for b in raw)


# --- reading tokenizer.json -------------------------------------------------------------------------------------


def split_pattern(pre_tokenizer: dict | None) -> str:
    """The tiktoken regex equivalent to a `tokenizer.json` pre-tokenizer (the shapes byte-level BPEs use)."""
    steps = pre_tokenizer.get("pretokenizers", []) if pre_tokenizer and pre_tokenizer["type"] == "Sequence" else []
    kinds = [s["type"] for s in steps] if steps else [pre_tokenizer and pre_tokenizer["type"]]
    last = (steps or [pre_tokenizer])[-1] or {}
    if last.get("type") == "ByteLevel" and not last.get("add_prefix_space", False):
        if kinds == ["ByteLevel"] and last.get("use_regex", True):
            return GPT2_PATTERN
        if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and last.get("use_regex", True):
            return SMOLLM_PATTERN
        split = steps[0] if steps else {}
        if (
            kinds == ["Split", "ByteLevel"]
            and not last.get("use_regex", True)
            and "Regex" in split["pattern"]
            and split.get("behavior") == "Isolated"
            and not split.get("invert")
        ):
            return split["pattern"]["Regex"]
    raise ValueError(
        f"unsupported pre-tokenizer {json.dumps(pre_tokenizer)[:300]}; supported: ByteLevel (GPT-2), "
        "Digits + ByteLevel (SmolLM), Split(regex) + ByteLevel (Llama-3)"
    )


def _unspellable(missing: set[int]) -> str:
    """Regex class items for the characters a vocabulary lacking the single-byte tokens `missing` cannot spell.

    SmolLM2's vocabulary has no token for a few ASCII control characters (e.g. 0x04) nor for the UTF-8 lead
    bytes 0xF1 and 0xF2 (planes 4-11, where Unicode assigns no characters). Hugging Face silently drops such
    bytes; tiktoken would crash. Excluding these characters from every `[^...]` class of the split regex (the
    only classes that could match them) leaves them unmatched, and tiktoken skips unmatched text.
    """
    items = []
    for b in sorted(missing):
        if b in (0xC0, 0xC1) or b >= 0xF5:  # never appear in UTF-8
            continue
        if b < 0x80 and unicodedata.category(chr(b)) == "Cc":
            items.append(f"\\x{{{b:X}}}")
        elif b in (0xF1, 0xF2):
            lo = (b & 0x07) << 18  # the lead byte's 3 low bits are the top bits of the code point
            items.append(f"\\x{{{lo:X}}}-\\x{{{lo + 0x3FFFF:X}}}")
        else:
            raise ValueError(f"the vocabulary has no token for byte 0x{b:02X}, which real text needs")
    return "".join(items)


def encoding_from_hf(tokenizer_json: dict, name: str = "bpe") -> tiktoken.Encoding:
    """A tiktoken Encoding equivalent to a byte-level BPE `tokenizer.json` (as a dict).

    tiktoken merges, within a piece, the adjacent pair whose concatenation has the lowest rank; Hugging Face
    applies the listed merges in order. Using token ids as ranks is therefore equivalent only if the tokens
    that merges create have increasing ids in merge order, which we check. tiktoken also takes a piece that is
    a token as that token without merging (Hugging Face's `ignore_merges`); in a vocabulary learned by BPE the
    merges reach every token from its own bytes, so this changes nothing there.
    """
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or tokenizer_json.get("normalizer"):
        raise ValueError(
            f"{name}: not a byte-level BPE tokenizer (model {model.get('type')!r}, byte_fallback "
            f"{model.get('byte_fallback')}, normalizer {tokenizer_json.get('normalizer')}); SentencePiece "
            "vocabularies (Llama-2 and older) are not supported"
        )
    pattern = split_pattern(tokenizer_json.get("pre_tokenizer"))
    vocab: dict[str, int] = model["vocab"]
    added = {t["content"]: t["id"] for t in tokenizer_json.get("added_tokens", [])}
    ranks = {token_bytes(token): i for token, i in vocab.items() if token not in added}
    if len(ranks) != len(vocab) - len(added.keys() & vocab.keys()):
        raise ValueError(f"{name}: two vocabulary entries spell the same bytes")
    previous = -1
    for n, merge in enumerate(model.get("merges", [])):
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        if left not in vocab or right not in vocab:
            raise ValueError(f"{name}: merge {n} ({left!r} + {right!r}) uses a token not in the vocabulary")
        merged = vocab.get(left + right)
        if merged is None or merged <= previous:
            raise ValueError(
                f"{name}: merge {n} ({left!r} + {right!r}) gives token id {merged}, not above the previous "
                f"merge's {previous}; tiktoken needs ids in merge order"
            )
        previous = merged
    missing = {b for b in range(256) if bytes([b]) not in ranks}
    if exclude := _unspellable(missing):
        pattern = pattern.replace("[^", "[^" + exclude)
    return tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=added)


def chat_format_of(chat_template: str | None) -> str | None:
    """Which of the chat formats `Tokenizer` knows a Jinja chat template writes."""
    if not chat_template:
        return None
    if "<|im_start|>" in chat_template:
        return "chatml"
    if "<|start_header_id|>" in chat_template:
        return "llama3"
    return None


def default_system_prompt(chat_template: str | None) -> str | None:
    """The system message a ChatML template inserts when a dialog has none (SmolLM2: "You are a helpful AI
    assistant named SmolLM, trained by Hugging Face"), or None."""
    found = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", chat_template or "", re.DOTALL)
    return found.group(1) if found else None


@dataclass(frozen=True)
class TokenizerParts:
    """What a `Tokenizer` is built from (the arguments of `Tokenizer.from_encoding`). This module returns it
    rather than a `Tokenizer`, so that it needs nothing from `tokenizer.py`."""

    encoding: tiktoken.Encoding
    bos_id: int | None  # None: the model expects no begin-of-text token
    eos_id: int
    pad_id: int
    special_tokens: dict[str, int]  # the added tokens, name -> id
    chat_format: str | None  # "llama3", "chatml" or None
    default_system_prompt: str | None


def parts_from_hf(tokenizer_json: dict, tokenizer_config: dict | None = None, name: str = "bpe") -> TokenizerParts:
    """The parts of a tokenizer from the contents of `tokenizer.json` and (optionally) `tokenizer_config.json`."""
    config = tokenizer_config or {}
    encoding = encoding_from_hf(tokenizer_json, name)
    special = {t["content"]: t["id"] for t in tokenizer_json.get("added_tokens", [])}

    def special_id(key: str) -> int | None:
        token = config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if token is not None and token not in special:
            raise ValueError(f"{name}: {key} {token!r} is not one of the tokenizer's added tokens")
        return special.get(token)

    bos, eos, pad = special_id("bos_token"), special_id("eos_token"), special_id("pad_token")
    if eos is None:
        raise ValueError(f"{name}: no eos_token in tokenizer_config.json")
    return TokenizerParts(
        encoding,
        bos_id=bos if _adds_bos(tokenizer_json, config, bos) else None,
        eos_id=eos,
        pad_id=eos if pad is None else pad,
        special_tokens=special,
        chat_format=chat_format_of(config.get("chat_template")),
        default_system_prompt=default_system_prompt(config.get("chat_template")),
    )


def _adds_bos(tokenizer_json: dict, config: dict, bos: int | None) -> bool:
    """Whether the model expects a begin-of-text token in front of text: `add_bos_token`, or else a
    post-processor template that starts with it (Llama-3's tokenizer.json)."""
    if bos is None:
        return False
    if "add_bos_token" in config:
        return bool(config["add_bos_token"])
    post = tokenizer_json.get("post_processor") or {}
    for step in post.get("processors", [post]):  # a Sequence of post-processors, or a single one
        template = step.get("single") or [{}]
        if template[0].get("SpecialToken", {}).get("id") == config.get("bos_token"):
            return True
    return False


def parts_from_hf_json(path: str | Path) -> TokenizerParts:
    """Read a Hugging Face `tokenizer.json` (and the `tokenizer_config.json` beside it, for bos/eos/pad and
    the chat template) of a byte-level BPE vocabulary. `Tokenizer.from_hf_json` calls this."""
    path = Path(path)
    try:
        tokenizer_json = json.loads(path.read_text(encoding="utf-8"))
        config_path = path.with_name("tokenizer_config.json")
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{path.parent}: invalid JSON in a tokenizer file: {e}") from None
    try:
        return parts_from_hf(tokenizer_json, config, name=path.parent.name or path.name)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a tokenizer.json this reader understands (at {e!r})") from None


# --- writing tokenizer.json from GGUF metadata ------------------------------------------------------------------


def hf_tokenizer_files(meta: dict, source: str = "GGUF") -> tuple[dict, dict]:
    """`tokenizer.json` and `tokenizer_config.json` contents for the `tokenizer.*` entries of GGUF metadata.

    Control tokens (<|im_start|>, ...) become special added tokens, user-defined ones plain added tokens, as in
    transformers' own GGUF reader; the pre-tokenizer is the one `tokenizer.ggml.pre` names.
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"{source}: tokenizer.ggml.model {kind!r} is not supported; only 'gpt2' (byte-level BPE, as in "
            "SmolLM2 and Llama-3) is"
        )
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"{source}: pre-tokenizer tokenizer.ggml.pre={pre!r} is not supported; supported: "
            f"{', '.join(PRE_TOKENIZERS)}"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if "tokenizer.ggml.merges" not in meta:
        raise ValueError(f"{source}: no tokenizer.ggml.merges; a byte-level BPE needs its merges")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{source}: the token list holds duplicates")
    tokenizer_json = byte_level_bpe_json(
        added_tokens=_added_tokens(tokens, types),
        pre_tokenizer=PRE_TOKENIZERS[pre],
        vocab=vocab,
        merges=[merge.split(" ") for merge in meta["tokenizer.ggml.merges"]],
        # A piece that is itself a token becomes that token, merges or not: what tiktoken always does, and what
        # Llama-3 (whose merges do not reach every token) needs. Other vocabularies apply the merges.
        ignore_merges=pre in _LLAMA3_NAMES,
    )
    return tokenizer_json, _hf_config(meta, tokens)


def byte_level_bpe_json(
    *,
    added_tokens: list[dict],
    pre_tokenizer: dict,
    vocab: dict[str, int],
    merges: list[list[str]],
    ignore_merges: bool,
    post_processor: dict | None = None,
) -> dict:
    """The `tokenizer.json` of a byte-level BPE (the Hugging Face tokenizers format), from its parts: what a GGUF's
    vocabulary and a Llama-3 tiktoken file both become."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens,
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": ignore_merges,
            "vocab": vocab,
            "merges": merges,
        },
    }


def _added_tokens(tokens: list[str], types: list[int]) -> list[dict]:
    """`tokenizer.json`'s added tokens: the control and user-defined ones (only control ones are special)."""
    return [
        {
            "id": i,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": kind == CONTROL,
        }
        for i, (token, kind) in enumerate(zip(tokens, types, strict=True))
        if kind in (CONTROL, USER_DEFINED)
    ]


def _hf_config(meta: dict, tokens: list[str]) -> dict:
    """`tokenizer_config.json` contents for GGUF metadata: the special tokens by name, and the chat template."""

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        # llama.cpp's default for a BPE vocabulary that does not say: no begin-of-text token.
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta.get(f"{meta.get('general.architecture')}.context_length", 8192),
    }
    if template := meta.get("tokenizer.chat_template"):
        config["chat_template"] = template
    return config
