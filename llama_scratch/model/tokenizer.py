"""Text <-> token ids: the Llama-3 byte-level BPE on tiktoken, its special tokens, and the chat format.

The vocabulary file (`tokenizer.model`) lists 128,000 byte sequences with their merge ranks; 256 special
tokens follow them (ids 128000-128255). Tokens, names and numbers match Meta's reference
(`llama_models.llama3.tokenizer.Tokenizer`) token for token; tests/model/test_tokenizer.py checks that.

Other byte-level BPE tokenizers (GPT-2 style ones from GGUF or a Hugging Face `tokenizer.json`) are read by
`llama_scratch.model.bpe` and plug in through `Tokenizer.from_hf_json` / `from_encoding`, so the rest of the package
only ever sees this one class.
"""

from __future__ import annotations

import base64
import binascii
import importlib.util
import re
from collections.abc import Iterable, Mapping, Sequence, Set
from pathlib import Path

import tiktoken

from .bpe import LLAMA3_PATTERN, TokenizerParts, parts_from_hf, parts_from_hf_json

# The named special tokens in id order from 128000; ids 128002, 128003 and 128012-128255 are reserved.
_LLAMA3_NAMED = [
    "<|begin_of_text|>",  # 128000: starts every sequence
    "<|end_of_text|>",  # 128001: ends a document (base models)
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",  # 128004: padding, never produced by text
    "<|step_id|>",
    "<|start_header_id|>",  # 128006: chat role header ...
    "<|end_header_id|>",  # 128007: ... ends here
    "<|eom_id|>",  # 128008: end of message (a tool call follows)
    "<|eot_id|>",  # 128009: end of turn (instruct models stop here)
    "<|python_tag|>",
    "<|image|>",
]
LLAMA3_NUM_SPECIAL = 256

# tiktoken panics on inputs above ~400k characters, and older tiktoken versions (< 0.8) slow down quadratically on
# long runs of whitespace or non-whitespace (github.com/openai/tiktoken/issues/195). Meta's reference therefore
# encodes at most 400k characters at a time and cuts runs longer than 25k characters; we cut at the same places,
# so long inputs give the same ids as the reference.
MAX_CHUNK_CHARS = 400_000
MAX_RUN_CHARS = 25_000
# A whitespace or non-whitespace run longer than MAX_RUN_CHARS. The lookbehinds make matches start only where a
# run starts, which keeps the search linear in the text length. Python's \s is exactly str.isspace().
_LONG_RUN = re.compile(rf"(?<!\s)\s{{{MAX_RUN_CHARS + 1},}}|(?<!\S)\S{{{MAX_RUN_CHARS + 1},}}")

CHAT_ROLES = ("system", "user", "assistant", "tool", "ipython")


def read_tiktoken_bpe(path: str | Path) -> dict[bytes, int]:
    """Read a tiktoken BPE file (one `<base64 bytes> <rank>` per line), failing loudly on anything else.

    Meta's loader skips lines it cannot parse; a truncated or wrong file would then tokenize differently
    without a word, so we refuse it and say where it broke.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; pass the tokenizer.model file or use Tokenizer.for_checkpoint")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"tokenizer file not found: {path}") from None
    except UnicodeDecodeError:
        raise ValueError(
            f"{path} is not a tiktoken BPE file (it is not text); Llama-3 uses tiktoken's format, "
            "a SentencePiece tokenizer.model (Llama-2) is not supported"
        ) from None
    ranks: dict[bytes, int] = {}
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise ValueError(f"{path}, line {line_no}: expected '<base64 token> <rank>', got {line[:80]!r}") from None
    if not ranks:
        raise ValueError(f"{path} holds no tokens; is it a tiktoken BPE file?")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not 0..{len(ranks) - 1} without gaps or repeats; the file is damaged")
    return ranks


def llama3_special_tokens(num_base_tokens: int = 128_000) -> dict[str, int]:
    """The 256 Llama-3 special tokens, named and numbered as in Meta's reference, after the base vocabulary."""
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(2, 2 + LLAMA3_NUM_SPECIAL - len(_LLAMA3_NAMED))]
    return {name: num_base_tokens + i for i, name in enumerate(_LLAMA3_NAMED + reserved)}


def default_model_path() -> Path:
    """Where the `llama-models` package keeps Meta's Llama-3 tokenizer.model (found without importing it)."""
    spec = importlib.util.find_spec("llama_models")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "Tokenizer.default() needs the llama-models package (pip install llama-models), "
            "or pass the path of a tokenizer.model to Tokenizer(...)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "llama3" / "tokenizer.model"


def _pieces(text: str) -> Iterable[str]:
    """Cut `text` where Meta's reference cuts it: chunks of 400k characters, runs of at most 25k characters."""
    if len(text) <= MAX_RUN_CHARS:  # the usual case: too short to hold a long run
        yield text
        return
    for start in range(0, len(text), MAX_CHUNK_CHARS):
        chunk = text[start : start + MAX_CHUNK_CHARS]
        cut = 0
        for run in _LONG_RUN.finditer(chunk):
            for pos in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS):
                yield chunk[cut:pos]
                cut = pos
        yield chunk[cut:]


class Tokenizer:
    """Byte-level BPE tokenizer: `encode` text to ids, `decode` ids to text, `encode_chat` a dialog.

    `Tokenizer(path)` loads a Llama-3 `tokenizer.model`; `Tokenizer.default()` the copy inside `llama-models`;
    `Tokenizer.for_checkpoint(dir)` whatever a checkpoint directory holds; `Tokenizer.from_hf_json(path)` a
    Hugging Face `tokenizer.json`; `Tokenizer.from_encoding(...)` wraps any tiktoken Encoding (the hook for
    non-Llama-3 vocabularies).
    """

    encoding: tiktoken.Encoding  # the tiktoken encoder doing the work
    special_tokens: dict[str, int]  # name -> id, e.g. {"<|begin_of_text|>": 128000, ...}
    bos_id: int | None  # begin of text; None for vocabularies whose models use none
    eos_id: int  # end of text
    pad_id: int  # fills padded batch positions; never produced by encoding text
    chat_format: str | None  # "llama3", "chatml" or None (no chat template)

    def __init__(self, model_path: str | Path) -> None:
        """Load a Llama-3 tiktoken `tokenizer.model` (base vocabulary) and add the Llama-3 special tokens.

        Padding uses `<|finetune_right_pad_id|>` (128004), the id Meta reserves for it: default encoding never
        produces a special token, so padding cannot be mistaken for text, and unlike `<|end_of_text|>` it never
        marks a real end of text (a classifier that pools the last real token must not confuse the two).
        """
        model_path = Path(model_path)
        ranks = read_tiktoken_bpe(model_path)
        special = llama3_special_tokens(len(ranks))
        encoding = tiktoken.Encoding(
            name=model_path.name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=special
        )
        self._setup(
            encoding,
            bos_id=special["<|begin_of_text|>"],
            eos_id=special["<|end_of_text|>"],
            pad_id=special["<|finetune_right_pad_id|>"],
            special_tokens=special,
            chat_format="llama3",
        )

    @classmethod
    def from_encoding(
        cls,
        encoding: tiktoken.Encoding,
        *,
        bos_id: int | None,
        eos_id: int,
        pad_id: int,
        special_tokens: Mapping[str, int] | None = None,
        chat_format: str | None = "llama3",
        default_system_prompt: str | None = None,
    ) -> Tokenizer:
        """A Tokenizer over any tiktoken Encoding: the hook for other byte-level BPE vocabularies.

        `from_hf`/`from_hf_json` call this with the `tiktoken.Encoding` that `llama_scratch.model.bpe` builds from a
        Hugging Face `tokenizer.json` (GPT-2 style BPE, e.g. SmolLM2), so training and classification code
        needs no second tokenizer class. `special_tokens` defaults to the encoding's own; `bos_id=None` means the
        model uses no begin-of-text token (`bos=True` then adds nothing). `chat_format` is "llama3"
        (<|start_header_id|>role<|end_header_id|>...<|eot_id|>), "chatml" (<|im_start|>role ...<|im_end|>, as
        SmolLM2 and Qwen use) or None; the tokens it needs must be among `special_tokens`.
        `default_system_prompt` is put first in a dialog that has no system message, as some chat templates do
        (SmolLM2's names itself in one).
        """
        if special_tokens is None:
            special_tokens = {name: encoding.encode_single_token(name) for name in encoding.special_tokens_set}
        self = cls.__new__(cls)
        self._setup(
            encoding,
            bos_id=bos_id,
            eos_id=eos_id,
            pad_id=pad_id,
            special_tokens=dict(special_tokens),
            chat_format=chat_format,
        )
        self.default_system_prompt = default_system_prompt
        return self

    @classmethod
    def from_hf(cls, tokenizer_json: dict, tokenizer_config: dict | None = None, name: str = "bpe") -> Tokenizer:
        """A Tokenizer from the contents (dicts) of a byte-level BPE `tokenizer.json` and `tokenizer_config.json`,
        e.g. the ones `llama_scratch.model.bpe.hf_tokenizer_files` builds from GGUF metadata."""
        return cls._from_parts(parts_from_hf(tokenizer_json, tokenizer_config, name))

    @classmethod
    def from_hf_json(cls, path: str | Path) -> Tokenizer:
        """Read a Hugging Face `tokenizer.json` of a byte-level BPE, with the `tokenizer_config.json` beside it."""
        return cls._from_parts(parts_from_hf_json(path))

    @classmethod
    def _from_parts(cls, parts: TokenizerParts) -> Tokenizer:
        return cls.from_encoding(
            parts.encoding,
            bos_id=parts.bos_id,
            eos_id=parts.eos_id,
            pad_id=parts.pad_id,
            special_tokens=parts.special_tokens,
            chat_format=parts.chat_format,
            default_system_prompt=parts.default_system_prompt,
        )

    def _setup(
        self,
        encoding: tiktoken.Encoding,
        *,
        bos_id: int | None,
        eos_id: int,
        pad_id: int,
        special_tokens: dict[str, int],
        chat_format: str | None,
    ) -> None:
        n = encoding.n_vocab
        for name, value in {"bos_id": bos_id, "eos_id": eos_id, "pad_id": pad_id}.items():
            if value is not None and not 0 <= value < n:
                raise ValueError(f"{name}={value} is outside the vocabulary of {n} tokens")
        for name, value in special_tokens.items():
            try:
                ok = encoding.encode_single_token(name) == value
            except KeyError:
                ok = False
            if not ok:
                raise ValueError(f"special token {name!r} is not token {value} of the encoding {encoding.name!r}")
        needed = {
            "llama3": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
            "chatml": ["<|im_start|>", "<|im_end|>"],
        }
        if chat_format is not None and chat_format not in needed:
            raise ValueError(f"unknown chat_format {chat_format!r}; use 'llama3', 'chatml' or None")
        if missing := [t for t in needed.get(chat_format, []) if t not in special_tokens]:
            raise ValueError(f"chat_format {chat_format!r} needs special token(s) {', '.join(missing)}")
        self.encoding = encoding
        self.special_tokens = special_tokens
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.chat_format = chat_format
        self.default_system_prompt: str | None = None

    @classmethod
    def default(cls) -> Tokenizer:
        """Meta's Llama-3 tokenizer as shipped in the `llama-models` package: works offline, no download."""
        return cls(default_model_path())

    @classmethod
    def for_checkpoint(cls, path: str | Path) -> Tokenizer:
        """The tokenizer of a checkpoint directory (or a tokenizer file itself).

        Looks for `tokenizer.model` (Meta's layout), then `original/tokenizer.model` (Hugging Face's layout of
        Llama-3 repos), then `tokenizer.json` (read by `from_hf_json`: the way in for other BPE vocabularies).
        """
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"checkpoint directory not found: {path}")
        if path.is_file():
            return cls.from_hf_json(path) if path.suffix == ".json" else cls(path)
        candidates = [path / "tokenizer.model", path / "original" / "tokenizer.model"]
        for candidate in candidates:
            if candidate.is_file():
                return cls(candidate)
        if (path / "tokenizer.json").is_file():
            return cls.from_hf_json(path / "tokenizer.json")
        looked = ", ".join(str(p) for p in [*candidates, path / "tokenizer.json"])
        raise FileNotFoundError(f"no tokenizer in {path} (looked for {looked})")

    @property
    def n_words(self) -> int:
        """Vocabulary size including special tokens (128,256 for Llama-3): the rows the embedding needs."""
        return self.encoding.n_vocab

    vocab_size = n_words

    @property
    def eot_id(self) -> int | None:
        """The token that ends a chat turn (`<|eot_id|>` / `<|im_end|>`); None without a chat format."""
        name = {"llama3": "<|eot_id|>", "chatml": "<|im_end|>"}.get(self.chat_format)
        return self.special_tokens[name] if name else None

    @property
    def stop_ids(self) -> list[int]:
        """Ids after which generation stops: end of text, and the end-of-turn/message tokens."""
        names = ("<|eom_id|>", "<|endoftext|>")  # Llama-3's end of a tool call; GPT-2-style end of document
        ids = {self.eos_id, self.eot_id, *(self.special_tokens.get(n) for n in names)}
        return sorted(i for i in ids if i is not None)

    def encode(
        self, text: str, *, bos: bool = False, eos: bool = False, allow_special: bool | Set[str] = False
    ) -> list[int]:
        """Token ids of `text`, with `<|begin_of_text|>` / `<|end_of_text|>` added when asked.

        Special-token strings inside `text` (say a user typing "<|eot_id|>") are encoded as ordinary text, so
        data cannot inject control tokens. `allow_special=True` (all) or a set of names turns them into tokens.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        if allow_special is True:
            allowed: Set[str] | str = "all"
        elif allow_special:
            if unknown := set(allow_special) - self.special_tokens.keys():
                raise ValueError(f"not special tokens of this vocabulary: {', '.join(sorted(unknown))}")
            allowed = set(allow_special)
        else:
            allowed = set()
        ids = [self.bos_id] if bos and self.bos_id is not None else []
        for piece in _pieces(text):
            if allowed:
                ids += self.encoding.encode(piece, allowed_special=allowed, disallowed_special=())
            else:
                ids += self.encoding.encode_ordinary(piece)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` (a list, or a 1-D tensor/array); special tokens appear as their names.

        Bytes that are not valid UTF-8 on their own (a cut-off multi-byte character) become U+FFFD.
        """
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        try:
            return self.encoding.decode(ids)
        except (KeyError, OverflowError):
            bad = [i for i in ids if not 0 <= i < self.n_words]
            raise ValueError(f"token id(s) {bad[:5]} outside the vocabulary of {self.n_words}") from None

    def encode_chat(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a dialog in the model's chat format; messages are {"role": ..., "content": ...} dicts.

        Llama-3 instruct: <|begin_of_text|> then per message
        `<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>`, and with `add_generation_prompt`
        an open assistant header for the model to continue. Same ids as Meta's `ChatFormat.encode_dialog_prompt`
        (which keeps content as given; Hugging Face's template strips surrounding whitespace first). ChatML:
        `<|im_start|>{role}\\n{content}<|im_end|>\\n`, no begin-of-text token. Content is encoded as text, so
        special-token strings in it stay text.
        """
        if self.chat_format is None:
            raise ValueError("this tokenizer has no chat format")
        ids = [self.bos_id] if self.chat_format == "llama3" and self.bos_id is not None else []
        if self.default_system_prompt is not None and (not messages or messages[0].get("role") != "system"):
            messages = [{"role": "system", "content": self.default_system_prompt}, *messages]
        for i, message in enumerate(messages):
            role, content = message.get("role"), message.get("content")
            if role not in CHAT_ROLES or not isinstance(content, str):
                raise ValueError(
                    f"message {i}: need role in {CHAT_ROLES} and str content, got role={role!r}, "
                    f"content of type {type(content).__name__}"
                )
            ids += self._chat_header(role) + self.encode(content) + self._chat_end()
        if add_generation_prompt:
            ids += self._chat_header("assistant")
        return ids

    def _chat_header(self, role: str) -> list[int]:
        s = self.special_tokens
        if self.chat_format == "llama3":
            role = "ipython" if role == "tool" else role  # Llama-3 calls the tool-output role "ipython"
            return [s["<|start_header_id|>"], *self.encode(role), s["<|end_header_id|>"], *self.encode("\n\n")]
        return [s["<|im_start|>"], *self.encode(role + "\n")]

    def _chat_end(self) -> list[int]:
        if self.chat_format == "llama3":
            return [self.special_tokens["<|eot_id|>"]]
        return [self.special_tokens["<|im_end|>"], *self.encode("\n")]

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.encoding.name!r}, n_words={self.n_words}, bos_id={self.bos_id}, eos_id={self.eos_id}, "
            f"pad_id={self.pad_id}, chat_format={self.chat_format!r})"
        )
