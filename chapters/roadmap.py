"""Two pictures every chapter opens with: the Llama-3 block diagram, and where the chapter sits among the others.

The notebooks run with `chapters/` as their working directory, so they import this file as `roadmap`.
Both functions draw with matplotlib only; nothing is read from image files, so nothing can go stale.
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

HERE = Path(__file__).resolve().parent

# Short titles of the chapters, by number (the notebooks' own titles are longer).
CHAPTERS = {
    1: "configuration\nand size",
    2: "RMSNorm\nand RoPE",
    3: "attention\nand masks",
    4: "the whole\nmodel",
    5: "the\ntokenizer",
    6: "loading\nweights",
    7: "classification\nhead",
    8: "fine-tuning\non SMS spam",
    9: "several\nGPUs",
    10: "generating\ntext",
    11: "LoRA",
    12: "four bits",
}

# The parts of the block diagram, left to right: (key, label, kind). Text flows from the tokenizer to the head;
# the six parts between the embedding and the final norm repeat N times (16 in Llama-3.2-1B, 32 in Llama-3-8B).
PARTS = [
    ("tokenizer", "tokenizer", "box"),
    ("embedding", "token\nembedding", "box"),
    ("attn_norm", "RMSNorm", "box"),
    ("attention", "grouped-query\nattention\nwith RoPE", "box"),
    ("attn_add", "+", "add"),
    ("ffn_norm", "RMSNorm", "box"),
    ("ffn", "SwiGLU\nfeed-forward", "box"),
    ("ffn_add", "+", "add"),
    ("final_norm", "final\nRMSNorm", "box"),
    ("head", "head\n(next token\nor class)", "box"),
]
BLOCK = ("attn_norm", "ffn_add")  # the first and last part of the repeated block
EVERYTHING = tuple(key for key, _, _ in PARTS)
MODEL = tuple(key for key in EVERYTHING if key != "tokenizer")

# What each chapter builds or works on, as parts of the diagram.
BUILDS = {
    1: MODEL,  # sizes of every part
    2: ("attn_norm", "ffn_norm", "final_norm", "attention"),  # the norms, and RoPE inside attention
    3: ("attention",),
    4: ("embedding", "attn_add", "ffn", "ffn_add", "head"),  # SwiGLU and the stack around it
    5: ("tokenizer",),
    6: MODEL,  # every weight
    7: ("final_norm", "head"),
    8: ("attn_norm", "attention", "attn_add", "ffn_norm", "ffn", "ffn_add", "final_norm", "head"),  # the top blocks
    9: EVERYTHING,  # the whole training run, copied on each GPU or sharded across them
    10: ("attention", "head"),  # the key/value cache and the next-token head
    11: ("attention", "ffn"),  # adapters on the seven projections
    12: ("attention", "ffn"),  # their frozen weights held in 4 bits (NF4), adapters on top
}

HIGHLIGHT = "#f4a261"
PLAIN = "#e9eef5"
EDGE = "#34495e"


def notebook_numbers() -> list[int]:
    """The chapter numbers of the notebooks next to this file."""
    return sorted(int(p.name[:2]) for p in HERE.glob("[0-9][0-9]_*.ipynb"))


def block_diagram(ax=None, highlight=()):
    """Draw a Llama-3 model left to right, its repeated block framed, and return the axes.

    `highlight`: keys of PARTS to colour (for a chapter, `BUILDS[chapter]`).
    """
    unknown = set(highlight) - set(EVERYTHING)
    assert not unknown, f"no such parts: {unknown}"
    if ax is None:
        _, ax = plt.subplots(figsize=(13, 2.8))
    width, height, gap = 1.05, 1.0, 0.35
    centers = {}
    x = 0.0
    for key, label, kind in PARTS:
        color = HIGHLIGHT if key in highlight else PLAIN
        if kind == "add":  # a residual add: a small circle
            ax.add_patch(plt.Circle((x + 0.25, 0), 0.22, facecolor=color, edgecolor=EDGE))
            ax.text(x + 0.25, 0, label, ha="center", va="center", fontsize=12, weight="bold")
            centers[key] = (x + 0.25, 0.5)
            x += 0.5 + gap
        else:
            box = FancyBboxPatch(
                (x, -height / 2), width, height, boxstyle="round,pad=0.02", facecolor=color, edgecolor=EDGE
            )
            ax.add_patch(box)
            ax.text(x + width / 2, 0, label, ha="center", va="center", fontsize=8)
            centers[key] = (x + width / 2, width)
            x += width + gap
    keys = [key for key, _, _ in PARTS]
    for a, b in zip(keys, keys[1:], strict=False):  # the main flow
        (xa, wa), (xb, wb) = centers[a], centers[b]
        ax.add_patch(FancyArrowPatch((xa + wa / 2, 0), (xb - wb / 2, 0), arrowstyle="-|>", mutation_scale=10))
    # The residual connections: the stream skips each sub-layer and is added back after it.
    for start, add in (("attn_norm", "attn_add"), ("ffn_norm", "ffn_add")):
        xs = centers[start][0] - centers[start][1] / 2 - gap / 2
        xa = centers[add][0]
        ax.add_patch(
            FancyArrowPatch((xs, 0), (xa, 0.22), connectionstyle="arc3,rad=-0.35", arrowstyle="-|>", mutation_scale=10)
        )
    # The frame around the repeated block.
    left = centers[BLOCK[0]][0] - centers[BLOCK[0]][1] / 2 - gap * 0.75
    right = centers[BLOCK[1]][0] + centers[BLOCK[1]][1] / 2 + gap * 0.4
    ax.add_patch(Rectangle((left, -0.8), right - left, 2.0, fill=False, linestyle="--", edgecolor="grey"))
    ax.text((left + right) / 2, -0.95, "N x this block", ha="center", va="top", fontsize=9, color="grey")
    ax.set_xlim(-0.2, x)
    ax.set_ylim(-1.3, 1.3)
    ax.set_aspect("equal")
    ax.axis("off")
    return ax


def chapter_path(ax, chapter: int) -> int:
    """Draw every chapter as a box on a path, `chapter` highlighted; return how many boxes were drawn."""
    drawn = 0
    for n, title in CHAPTERS.items():
        color = HIGHLIGHT if n == chapter else PLAIN
        x = (n - 1) * 1.3
        ax.add_patch(FancyBboxPatch((x, 0), 1.1, 0.9, boxstyle="round,pad=0.02", facecolor=color, edgecolor=EDGE))
        ax.text(x + 0.55, 0.62, str(n), ha="center", va="center", fontsize=10, weight="bold")
        ax.text(x + 0.55, 0.28, title, ha="center", va="center", fontsize=6.5)
        if n > 1:
            ax.add_patch(FancyArrowPatch((x - 0.2, 0.45), (x, 0.45), arrowstyle="-|>", mutation_scale=8))
        drawn += 1
    ax.set_xlim(-0.1, len(CHAPTERS) * 1.3)
    ax.set_ylim(-0.1, 1.0)
    ax.set_aspect("equal")
    ax.axis("off")
    return drawn


def where_we_are(chapter: int) -> None:
    """The chapters as a path with this one highlighted, above the block diagram with what this chapter builds."""
    numbers = notebook_numbers()
    assert chapter in numbers, f"there is no chapter {chapter} in {HERE.name}/"
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 4.6), gridspec_kw={"height_ratios": [1, 2]})
    drawn = chapter_path(top, chapter)
    assert drawn == len(numbers) and list(CHAPTERS) == numbers, "one box per notebook, in order"
    title = re.sub(r"\s+", " ", CHAPTERS[chapter])
    top.set_title(f"Chapter {chapter} of {len(numbers)}: {title}", fontsize=11)
    block_diagram(bottom, BUILDS[chapter])
    bottom.set_title("highlighted: the parts of the model this chapter works on", fontsize=9, color="grey")
    fig.tight_layout()
    plt.show()
