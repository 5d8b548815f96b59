"""Attention over a packed stream, two ways: per text in a right-padded layout (`packing.Packed`, what the model
does) vs one block-diagonal causal mask over the whole stream (keys and values repeated per head, as the model
does with any mask). Forward and backward of one layer's attention (8 query heads, 2 key/value heads, head_dim
64, float32), alternating which goes first, median of 5 rounds of 20.

Run: python benchmarks/packed_attention.py
"""

import random
import statistics
import time

import torch
import torch.nn.functional as F

from llama_scratch.model.packing import pack

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def block_diagonal(lengths: list[int]) -> torch.Tensor:
    """[1, 1, N, N]: a token sees the earlier tokens of its own text and itself."""
    text = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    n = len(text)
    causal = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
    return ((text[:, None] == text[None, :]) & causal)[None, None]


def milliseconds(lengths: list[int], steps: int = 20) -> dict[str, float]:
    layout, mask, n = pack(lengths), block_diagonal(lengths), sum(lengths)
    q = torch.randn(1, HEADS, n, HEAD_DIM, requires_grad=True)
    k, v = (torch.randn(1, KV_HEADS, n, HEAD_DIM, requires_grad=True) for _ in range(2))

    def per_text() -> None:
        out = F.scaled_dot_product_attention(
            layout.pad(q), layout.pad(k), layout.pad(v), is_causal=True, enable_gqa=True
        )
        layout.unpad(out).sum().backward()

    def one_mask() -> None:
        keys, values = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
        F.scaled_dot_product_attention(q, keys, values, attn_mask=mask).sum().backward()

    times: dict[str, list[float]] = {"per_text": [], "one_mask": []}
    per_text(), one_mask()  # warm-up
    for r in range(5):
        for f in (per_text, one_mask) if r % 2 == 0 else (one_mask, per_text):
            start = time.perf_counter()
            for _ in range(steps):
                f()
            times[f.__name__].append((time.perf_counter() - start) / steps * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    torch.manual_seed(0)
    rng = random.Random(0)
    print("| texts | tokens | per text, padded layout (ms) | one block-diagonal mask (ms) | mask / per text |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for label, count, low, high in [("8 of 8-48", 8, 8, 48), ("16 of 16-128", 16, 16, 128), ("32 of 8-64", 32, 8, 64)]:
        lengths = [rng.randint(low, high) for _ in range(count)]
        ms = milliseconds(lengths)
        ratio = ms["one_mask"] / ms["per_text"]
        print(f"| {label} | {sum(lengths)} | {ms['per_text']:.2f} | {ms['one_mask']:.2f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
