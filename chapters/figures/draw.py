"""Draw the chapters' concept diagrams as PNG files: `python chapters/figures/draw.py [OUTPUT_DIR]`.

Each diagram is one function below, drawn with matplotlib patches, arrows and text only, so a wrong label or a
changed default is fixed here and the picture regenerated, never edited by hand. The numbers drawn (head counts,
widths, the NF4 levels, the vocabulary) are read from the package where it holds them, so a picture cannot say
something the code does not do. The chapters reference the files as `figures/NAME.png`; `tests/chapters/test_figures.py`
runs this script into a temporary folder and checks that every referenced file is written.

The output is deterministic: the Agg backend, no timestamps or software name in the PNG metadata, and a fixed
random seed for the one drawing with made-up weights, so a rerun rewrites the same bytes on the same matplotlib.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display needed, and the same renderer everywhere

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Arc, FancyArrowPatch, FancyBboxPatch, Rectangle  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the package, when this runs from a checkout without `pip install -e`

from llama_scratch.model.config import LlamaConfig  # noqa: E402
from llama_scratch.model.quantize import BLOCK, NF4  # noqa: E402

HERE = Path(__file__).resolve().parent
DPI = 120  # 9 inches wide: 1,080 pixels, sharp at a notebook's width

# One palette for every figure: what changed or trains is orange, what is frozen or fixed is blue-grey.
CHANGED = "#f4a261"
PLAIN = "#e9eef5"
FROZEN = "#c9d6e8"
TRAINED = "#f4a261"
CACHE = "#b7e4c7"
PAD = "#d9d9d9"
EDGE = "#34495e"
RED = "#c0392b"
GROUP_COLOURS = ["#e76f51", "#f4a261", "#e9c46a", "#8ab17d", "#2a9d8f", "#457b9d", "#9b5de5", "#f15bb5"]


# ------------------------------------------------------------------------------------------------ drawing kit


def canvas(width: float, height: float):
    """A figure whose data coordinates are inches: (0, 0) bottom left, (width, height) top right."""
    fig = plt.figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.set_axis_off()
    return fig, ax


def box(ax, x, y, w, h, text="", fc=PLAIN, fs=9, ec=EDGE, weight="normal", ls="-", color="black"):
    """A rounded box with its bottom-left corner at (x, y) and `text` centred in it."""
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0,rounding_size=0.06", fc=fc, ec=ec, lw=1.1, ls=ls))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fs, weight=weight, color=color)


def cell(ax, x, y, w, h, fc, text="", fs=7, ec=EDGE, color="black"):
    """A square-cornered cell (a token, a weight, a row of a tensor)."""
    ax.add_patch(Rectangle((x, y), w, h, fc=fc, ec=ec, lw=0.8))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fs, color=color)


def arrow(ax, start, end, color=EDGE, ls="-", lw=1.3, rad=0.0, style="-|>"):
    """An arrow from `start` to `end`, bent by `rad` (0: straight)."""
    ax.add_patch(
        FancyArrowPatch(
            start,
            end,
            arrowstyle=style,
            mutation_scale=11,
            color=color,
            lw=lw,
            ls=ls,
            connectionstyle=f"arc3,rad={rad}",
            shrinkA=1,
            shrinkB=1,
        )
    )


def label(ax, x, y, text, fs=9, ha="center", va="center", **kw):
    ax.text(x, y, text, fontsize=fs, ha=ha, va=va, **kw)


def save(fig, out: Path, name: str) -> Path:
    """Write `name`.png without metadata that changes from run to run."""
    path = out / f"{name}.png"
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------ the figures


def llama3_vs_gpt2_block(out: Path) -> Path:
    """Chapter 4: GPT-2's block beside Llama-3's, bottom to top, what changed in orange."""
    gpt2_layers, gpt2_dim, gpt2_heads, gpt2_vocab, gpt2_context = 12, 768, 12, 50_257, 1024  # GPT-2 small
    cfg = LlamaConfig.from_name("llama3-8b")
    fig, ax = canvas(9.0, 7.4)
    columns = [
        (
            0.3,
            f"GPT-2 (small: {gpt2_layers} blocks, width {gpt2_dim})",
            [
                ("token embedding", PLAIN),
                (f"+ learned position embedding\n({gpt2_context:,} positions, added at the input)", CHANGED),
            ],
            [
                ("LayerNorm (gain and bias)", CHANGED),
                (f"multi-head attention\n{gpt2_heads} query heads, {gpt2_heads} key/value heads; biases", CHANGED),
                ("MLP: Linear -> GELU -> Linear\ninner width 4 x 768 = 3,072; biases", CHANGED),
            ],
            [("final LayerNorm", CHANGED), (f"output = embedding (tied)\n{gpt2_vocab:,} scores", PLAIN)],
            f"x {gpt2_layers}",
        ),
        (
            4.7,
            f"Llama-3-8B ({cfg.n_layers} blocks, width {cfg.dim:,})",
            [
                ("token embedding", PLAIN),
                ("(no position embedding:\npositions enter as RoPE, inside attention)", PLAIN),
            ],
            [
                ("RMSNorm (gain only)", CHANGED),
                (
                    f"grouped-query attention, RoPE on q and k\n{cfg.n_heads} query heads share "
                    f"{cfg.n_kv_heads} key/value heads; no biases",
                    CHANGED,
                ),
                (f"SwiGLU: down(SiLU(gate x) * up x)\ninner width {cfg.ffn_dim:,}; no biases", CHANGED),
            ],
            [("final RMSNorm", CHANGED), (f"output projection (untied)\n{cfg.vocab_size:,} scores", PLAIN)],
            f"x {cfg.n_layers}",
        ),
    ]
    w = 4.0
    for x, title, inputs, block, top, repeat in columns:
        label(ax, x + w / 2, 7.15, title, fs=10, weight="bold")
        label(ax, x + w / 2, 0.25, "token ids", fs=9)
        arrow(ax, (x + w / 2, 0.4), (x + w / 2, 0.6))
        box(ax, x + 0.3, 0.6, w - 0.6, 0.4, inputs[0][0], fc=inputs[0][1])
        box(ax, x + 0.3, 1.15, w - 0.6, 0.55, inputs[1][0], fc=inputs[1][1], fs=8)
        arrow(ax, (x + w / 2, 1.0), (x + w / 2, 1.15))
        # The repeated block: norm, attention, add, norm, feed-forward, add.
        ax.add_patch(
            FancyBboxPatch((x, 1.95), w, 3.85, boxstyle="round,pad=0,rounding_size=0.1", fc="none", ec=EDGE, ls="--")
        )
        label(ax, x + w - 0.1, 2.1, repeat, fs=10, ha="right", weight="bold")
        arrow(ax, (x + w / 2, 1.7), (x + w / 2, 2.15))
        ys = {"norm1": 2.15, "attn": 2.7, "add1": 3.55, "norm2": 3.85, "ffn": 4.4, "add2": 5.35}
        box(ax, x + 0.5, ys["norm1"], w - 1.0, 0.35, block[0][0], fc=block[0][1], fs=8)
        arrow(ax, (x + w / 2, ys["norm1"] + 0.35), (x + w / 2, ys["attn"]))
        box(ax, x + 0.3, ys["attn"], w - 0.6, 0.6, block[1][0], fc=block[1][1], fs=8)
        box(ax, x + w / 2 - 0.12, ys["add1"] - 0.12, 0.24, 0.24, "+", fc="white", fs=10)
        arrow(ax, (x + w / 2, ys["attn"] + 0.6), (x + w / 2, ys["add1"] - 0.12))
        arrow(ax, (x + w / 2, ys["add1"] + 0.12), (x + w / 2, ys["norm2"]))
        box(ax, x + 0.5, ys["norm2"], w - 1.0, 0.35, block[0][0], fc=block[0][1], fs=8)
        arrow(ax, (x + w / 2, ys["norm2"] + 0.35), (x + w / 2, ys["ffn"]))
        box(ax, x + 0.3, ys["ffn"], w - 0.6, 0.6, block[2][0], fc=block[2][1], fs=8)
        box(ax, x + w / 2 - 0.12, ys["add2"] - 0.12, 0.24, 0.24, "+", fc="white", fs=10)
        arrow(ax, (x + w / 2, ys["ffn"] + 0.6), (x + w / 2, ys["add2"] - 0.12))
        # Residual connections: around each sublayer, on the left.
        for start, end in ((2.0, ys["add1"]), (ys["add1"] + 0.2, ys["add2"])):
            ax.plot([x + w / 2, x + 0.15, x + 0.15], [start, start, end], color=EDGE, lw=1)
            arrow(ax, (x + 0.15, end), (x + w / 2 - 0.12, end))
        label(ax, x + 0.2, 2.95, "residual", fs=7, ha="left", rotation=90, color=EDGE)
        arrow(ax, (x + w / 2, ys["add2"] + 0.12), (x + w / 2, 5.95))
        box(ax, x + 0.5, 5.95, w - 1.0, 0.35, top[0][0], fc=top[0][1], fs=8)
        arrow(ax, (x + w / 2, 6.3), (x + w / 2, 6.4))
        box(ax, x + 0.3, 6.4, w - 0.6, 0.5, top[1][0], fc=top[1][1], fs=8)
    return save(fig, out, "llama3_vs_gpt2_block")


def gqa_shapes(out: Path) -> Path:
    """Chapter 3: grouped-query attention's tensors at Llama-3-8B's size; query head h reads key/value head h // 4."""
    cfg = LlamaConfig.from_name("llama3-8b")
    q, kv, hd, dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim
    group = q // kv
    fig, ax = canvas(9.0, 4.3)
    label(ax, 4.5, 4.1, f"Grouped-query attention in Llama-3-8B: {q} query heads, {kv} key/value heads, head_dim {hd}")
    box(ax, 0.1, 1.75, 1.1, 0.7, f"x\n[B, T, {dim:,}]", fs=9)
    size, gap, group_gap, left = 0.11, 0.015, 0.07, 2.45
    group_width = group * (size + gap) - gap
    rows = [
        (3.2, f"q_proj\n{dim:,} -> {q * hd:,}\nthen RoPE", f"Q  [B, {q}, T, {hd}]", q),
        (1.85, f"k_proj\n{dim:,} -> {kv * hd:,}\nthen RoPE", f"K  [B, {kv}, T, {hd}]", kv),
        (0.55, f"v_proj\n{dim:,} -> {kv * hd:,}", f"V  [B, {kv}, T, {hd}]", kv),
    ]
    for y, proj, shape, heads in rows:
        arrow(ax, (1.2, 2.1), (1.45, y + 0.15))
        label(ax, 1.5, y + 0.15, proj, fs=7.5, ha="left")
        label(ax, left, y + 0.48, shape, fs=8.5, ha="left", weight="bold")
        for h in range(heads):
            g = h // group if heads == q else h
            start = left + g * (group_width + group_gap)
            if heads == q:
                cell(ax, start + (h % group) * (size + gap), y, size, 0.3, GROUP_COLOURS[g], str(h), fs=5.5)
            else:
                cell(ax, start, y, group_width, 0.3, GROUP_COLOURS[g], str(h), fs=7)
    for g in range(kv):  # each key/value head serves `group` query heads
        x = left + g * (group_width + group_gap) + group_width / 2
        arrow(ax, (x, 2.15), (x, 3.2), color=GROUP_COLOURS[g], lw=1.6)
    label(
        ax,
        left + 4 * (group_width + group_gap) - group_gap / 2,
        2.72,
        f"query head h reads key/value head h // {group}",
        fs=8,
        bbox={"fc": "white", "ec": "none", "pad": 1},
    )
    out_x = left + kv * (group_width + group_gap) + 0.3
    box(
        ax,
        out_x,
        1.45,
        1.65,
        1.3,
        f"softmax(Q K^T / sqrt({hd})) V\n-> [B, {q}, T, {hd}]\n-> [B, T, {q * hd:,}]\no_proj: {q * hd:,} -> {dim:,}",
        fs=7.5,
    )
    for y, *_ in rows:
        arrow(ax, (out_x - 0.15, y + 0.15), (out_x, 2.1))
    label(
        ax,
        left + 4 * (group_width + group_gap) - group_gap / 2,
        0.25,
        f"the values are shared the same way: query head h averages value head h // {group}",
        fs=8,
    )
    label(
        ax,
        out_x + 0.82,
        1.25,
        f"KV cache, per token and block:\n2 x {kv} x {hd} = {2 * kv * hd:,} numbers,\n"
        f"{group}x fewer than with\n{q} key/value heads",
        fs=7.5,
        va="top",
    )
    return save(fig, out, "gqa_shapes")


def rope_rotation(out: Path) -> Path:
    """Chapter 2: one channel pair of a query turned by position x frequency, and which channels pair up."""
    cfg = LlamaConfig.from_name("llama3-8b")
    d, theta = cfg.head_dim, cfg.rope_theta
    freq = [theta ** (-2 * i / d) for i in range(d // 2)]
    fig, ax = canvas(9.0, 4.2)
    # Left: the pair (channel i, channel i + d/2) of one query vector, at positions 0 to 3, pair 0 (1 radian a token).
    cx, cy, r = 2.0, 2.0, 1.35
    ax.add_patch(Arc((cx, cy), 2 * r, 2 * r, theta1=0, theta2=360, color="#bbbbbb", lw=1, ls="--"))
    arrow(ax, (cx - r - 0.2, cy), (cx + r + 0.3, cy), color="#999999", lw=0.8)
    arrow(ax, (cx, cy - r - 0.2), (cx, cy + r + 0.3), color="#999999", lw=0.8)
    label(ax, cx + r + 0.3, cy - 0.15, "channel i", fs=8, ha="right")
    label(ax, cx - 0.08, cy + r + 0.3, f"channel i + {d // 2}", fs=8, ha="right")
    start = 0.35  # the query's own angle before rotation, so position 0 is not on an axis
    for p in range(4):
        angle = start + p * freq[0]
        end = (cx + r * np.cos(angle), cy + r * np.sin(angle))
        arrow(ax, (cx, cy), end, color=GROUP_COLOURS[p * 2], lw=2)
        lx, ly = cx + (r + 0.28) * np.cos(angle), cy + (r + 0.28) * np.sin(angle)
        label(ax, lx, ly, f"position {p}", fs=8, color=GROUP_COLOURS[p * 2], weight="bold")
    ax.add_patch(Arc((cx, cy), 0.8, 0.8, theta1=np.degrees(start), theta2=np.degrees(start + freq[0]), color=EDGE))
    label(ax, cx + 0.62, cy + 0.52, "1 x f", fs=8)
    label(ax, cx, 0.2, "pair i = 0 turns f_0 = 1 radian a token; the length never changes", fs=8)
    # Right: a head of d channels, channel i paired with i + d/2, each pair with its own frequency.
    x0, y0, cw = 4.6, 2.75, 0.13
    label(ax, x0, 3.95, f"one query (or key) head: {d} channels", fs=9, ha="left", weight="bold")
    shown = [0, 1, 2, None, d // 2 - 1]
    for half, name in ((0, "first half"), (1, "second half")):
        for j, i in enumerate(shown):
            x = x0 + half * 2.2 + j * (cw + 0.02)
            if i is None:
                label(ax, x + cw / 2, y0 + 0.15, "...", fs=8)
                continue
            cell(ax, x, y0, cw, 0.3, GROUP_COLOURS[j])
            label(ax, x + cw / 2, y0 + 0.45, str(i + half * d // 2), fs=6.5, rotation=90)
        label(ax, x0 + half * 2.2 + 0.35, y0 - 0.2, name, fs=7.5)
    for j, i in enumerate(shown):
        if i is None:
            continue
        a = x0 + j * (cw + 0.02) + cw / 2
        ax.add_patch(
            FancyArrowPatch(
                (a, y0), (a + 2.2, y0), connectionstyle="arc3,rad=0.35", arrowstyle="-", color=GROUP_COLOURS[j], lw=1
            )
        )
    rows = [
        f"pair i = (channel i, channel i + {d // 2}), the Hugging Face layout",
        f"angle = position x f_i,   f_i = theta^(-2i/{d}),   theta = {theta:,.0f}",
        f"f_0 = 1 radian a token;  f_{d // 2 - 1} = {freq[-1]:.1e} "
        f"(a turn every {2 * np.pi / freq[-1] / 1e6:.1f} million tokens)",
        "q at position m and k at position n both turn: q . k then",
        "depends on their distance m - n only, never on m itself",
    ]
    for n, text in enumerate(rows):
        label(ax, x0, 1.7 - n * 0.3, text, fs=8, ha="left")
    return save(fig, out, "rope_rotation")


def padding_last_token(out: Path) -> Path:
    """Chapter 7: the last real token of each text, with right and with left padding, through the head to the loss."""
    lengths, width = [3, 5, 4], 5
    fig, ax = canvas(9.0, 4.4)
    cw, ch = 0.34, 0.32
    for side, x0 in (("right", 0.2), ("left", 3.2)):
        label(ax, x0 + width * cw / 2, 4.15, f"padded on the {side}", fs=9, weight="bold")
        for row, n in enumerate(lengths):
            y = 3.4 - row * 0.45
            first = 0 if side == "right" else width - n
            for col in range(width):
                real = first <= col < first + n
                last = col == first + n - 1
                cell(
                    ax,
                    x0 + col * cw,
                    y,
                    cw,
                    ch,
                    TRAINED if last else (PLAIN if real else PAD),
                    f"t{col - first + 1}" if real else "pad",
                    fs=7,
                )
            label(
                ax,
                x0 + width * cw + 0.08,
                y + ch / 2,
                "mask " + " ".join("1" if first <= c < first + n else "0" for c in range(width)),
                fs=7,
                ha="left",
            )
        if side == "right":  # the classic bug: the last column is a pad for the shorter rows
            ax.add_patch(
                Rectangle((x0 + (width - 1) * cw - 0.03, 2.45), cw + 0.06, 1.33, fc="none", ec=RED, lw=1.5, ls="--")
            )
            label(
                ax,
                x0 + width * cw / 2,
                2.2,
                "the last column is a pad\nfor two of the three texts: wrong",
                fs=7.5,
                color=RED,
            )
        else:
            label(ax, x0 + width * cw / 2, 2.2, "here the last column\nis each text's last token", fs=7.5)
    label(
        ax,
        3.0,
        1.45,
        "position read = the largest position whose mask is 1 (last_real_positions):\n"
        "right on either side. The training default packs the texts (no pads at all, chapter 7).",
        fs=8,
    )
    steps = [
        (6.3, 3.2, "the last real token's\nvector [3, dim]", TRAINED),
        (6.3, 2.25, "final RMSNorm, then\nhead: dim -> classes", PLAIN),
        (6.3, 1.3, "class scores\n[3, classes]", PLAIN),
        (6.3, 0.35, "cross-entropy with\nthe labels -> loss", PLAIN),
    ]
    for n, (x, y, text, fc) in enumerate(steps):
        box(ax, x, y, 2.4, 0.6, text, fc=fc, fs=8)
        if n:
            arrow(ax, (x + 1.2, y + 0.95), (x + 1.2, y + 0.6))
    arrow(ax, (5.85, 3.5), (6.3, 3.5))
    return save(fig, out, "padding_last_token")


def streaming_load(out: Path) -> Path:
    """Chapter 6: the naive load holds two models at once; streaming fills a meta-device model one tensor at a time."""
    fig, ax = canvas(9.0, 4.4)
    label(ax, 0.2, 4.15, "Naive: build, read everything, copy", fs=9.5, ha="left", weight="bold")
    box(ax, 0.2, 3.05, 2.0, 0.75, "Llama(cfg)\nrandom seed weights", fc=FROZEN, fs=8)
    box(ax, 2.6, 3.05, 2.0, 0.75, "load_file(...)\na full state dict", fc=FROZEN, fs=8)
    arrow(ax, (4.6, 3.42), (5.05, 3.42))
    box(ax, 5.05, 3.05, 1.5, 0.75, "load_state_dict:\ncopy, then drop\nthe state dict", fs=7.5)
    label(ax, 0.2, 2.55, "Streaming: build on meta, then one tensor at a time", fs=9.5, ha="left", weight="bold")
    names = ["header", "embed", "q_proj", "k_proj", "...", "lm_head"]
    x = 0.2
    for n, name in enumerate(names):
        w = 0.55 if name != "header" else 0.6
        cell(ax, x, 1.65, w, 0.45, PLAIN if n != 2 else TRAINED, name, fs=7)
        x += w
    label(ax, 1.8, 1.45, "model.safetensors: a JSON header, then each tensor's bytes", fs=7.5)
    arrow(ax, (1.8, 1.65), (1.8, 1.0))
    label(ax, 1.85, 1.3, "read one tensor,\nconvert its dtype", fs=7.5, ha="left")
    for n, name in enumerate(names[1:]):
        filled = n < 2
        cell(ax, 0.2 + n * 0.75, 0.35, 0.72, 0.5, FROZEN if filled else "white", name, fs=7, ec=EDGE)
    label(ax, 2.1, 0.15, "the model: meta placeholders replaced as they arrive", fs=7.5)
    # Memory over the load, in units of one checkpoint.
    bx, by, unit = 7.0, 0.6, 1.5
    ax.add_patch(Rectangle((bx, by), 0.6, unit, fc=FROZEN, ec=EDGE))
    ax.add_patch(Rectangle((bx, by + unit), 0.6, unit, fc=FROZEN, ec=EDGE, hatch="//"))
    label(ax, bx + 0.3, by + unit / 2, "seed\n1x", fs=8)
    label(ax, bx + 0.3, by + 1.5 * unit, "state\ndict\n1x", fs=8)
    ax.add_patch(Rectangle((bx + 1.0, by), 0.6, unit, fc=FROZEN, ec=EDGE))
    ax.add_patch(Rectangle((bx + 1.0, by + unit), 0.6, 0.12, fc=TRAINED, ec=EDGE))
    label(ax, bx + 1.3, by + unit / 2, "model\n1x", fs=8)
    label(ax, bx + 1.65, by + unit + 0.06, "+ one\ntensor", fs=7, ha="left", va="bottom")
    ax.plot([bx - 0.2, bx + 2.0], [by, by], color=EDGE, lw=1)
    label(ax, bx + 0.3, by - 0.2, "naive", fs=8)
    label(ax, bx + 1.3, by - 0.2, "streaming", fs=8)
    label(ax, bx + 0.8, by + 2 * unit + 0.35, "peak memory", fs=9, weight="bold")
    return save(fig, out, "streaming_load")


def prefix_cache_loop(out: Path) -> Path:
    """Chapter 8: the frozen bottom runs once per distinct text; each step runs only the trained top and the head."""
    fig, ax = canvas(9.0, 4.3)
    label(ax, 2.0, 4.1, "Once per distinct text", fs=9.5, weight="bold")
    label(ax, 2.0, 3.85, "(before training: the frozen pass, its output kept)", fs=7.5)
    column = [
        (0.3, "token ids", PLAIN),
        (0.95, "embedding (frozen)", FROZEN),
        (1.6, "blocks 0 .. L-k-1 (frozen)", FROZEN),
    ]
    for y, text, fc in column:
        box(ax, 0.6, y, 2.8, 0.45, text, fc=fc, fs=8)
    arrow(ax, (2.0, 0.75), (2.0, 0.95))
    arrow(ax, (2.0, 1.4), (2.0, 1.6))
    box(
        ax,
        0.6,
        2.5,
        2.8,
        0.9,
        "the cache: each text's states\nafter the frozen blocks,\none [length, dim] tensor a text",
        fc=CACHE,
        fs=8,
    )
    arrow(ax, (2.0, 2.05), (2.0, 2.5))
    label(ax, 6.5, 4.1, "Every optimizer step, every epoch", fs=9.5, weight="bold")
    steps = [
        (3.25, "a batch of cached states", CACHE),
        (2.6, "blocks L-k .. L-1 (trained)", TRAINED),
        (1.95, "final RMSNorm and head (trained)", TRAINED),
        (1.3, "cross-entropy loss", PLAIN),
    ]
    for y, text, fc in steps:
        box(ax, 5.0, y, 3.0, 0.45, text, fc=fc, fs=8)
    for (y, *_), (y2, *_) in zip(steps, steps[1:], strict=False):
        arrow(ax, (6.5, y), (6.5, y2 + 0.45))
    arrow(ax, (3.4, 2.95), (5.0, 3.45))
    label(ax, 4.2, 3.45, "read, not\nrecomputed", fs=7.5)
    arrow(ax, (8.0, 1.52), (8.0, 2.82), color=RED, rad=0.5, ls="--")
    label(ax, 8.5, 2.2, "backward,\nAdamW:\ntrained\nparts only", fs=7.5, color=RED)
    label(
        ax,
        6.5,
        0.65,
        "After the first pass, an epoch costs about\nk/L of a full forward and backward.\n"
        "L blocks, the last k trained (train_last = k);\nchapter 8 trains the last block.",
        fs=8,
    )
    return save(fig, out, "prefix_cache_loop")


def ddp_vs_fsdp(out: Path) -> Path:
    """Chapter 9: every process holds the whole model (DDP) against each holding a third of every tensor (FSDP)."""
    n = 3
    fig, ax = canvas(9.0, 4.6)
    parts = ["weights", "gradients", "AdamW moments"]
    for panel, (title, x0) in enumerate(
        (("DDP: every process holds everything", 0.2), ("FSDP (--shard): each process holds 1/3 of every tensor", 4.7))
    ):
        label(ax, x0 + 2.05, 4.4, title, fs=9, weight="bold")
        for r in range(n):
            x = x0 + r * 1.4
            box(ax, x, 1.45, 1.25, 2.6, "", fc="white")
            label(ax, x + 0.62, 3.85, f"process {r}", fs=8, weight="bold")
            label(ax, x + 0.62, 1.7, "its own third\nof each batch", fs=7)
            for k, part in enumerate(parts):
                y = 3.2 - k * 0.55
                label(ax, x + 0.62, y + 0.4, part, fs=7)
                for s in range(n):
                    held = panel == 0 or s == r
                    cell(
                        ax,
                        x + 0.1 + s * 0.35,
                        y,
                        0.35,
                        0.22,
                        GROUP_COLOURS[s * 2 + 1] if held else "white",
                        ec=EDGE if held else "#bbbbbb",
                    )
    # DDP: one collective after backward.
    ax.plot([0.8, 3.6], [1.2, 1.2], color=RED, lw=1.5)
    for r in range(n):
        arrow(ax, (0.82 + r * 1.4, 1.45), (0.82 + r * 1.4, 1.2), color=RED, style="<|-|>")
    label(
        ax,
        2.2,
        0.75,
        "after backward: all-reduce the gradients\n(sum, divide by 3): every process takes\n"
        "the same step on its whole copy",
        fs=7.5,
    )
    ax.plot([5.3, 8.1], [1.2, 1.2], color=RED, lw=1.5)
    for r in range(n):
        arrow(ax, (5.32 + r * 1.4, 1.45), (5.32 + r * 1.4, 1.2), color=RED, style="<|-|>")
    label(
        ax,
        6.7,
        0.65,
        "before a block runs (forward and backward): all-gather\nits rows, compute, free them. "
        "After backward: reduce-\nscatter, each gets the summed gradient of its own rows\nand steps only those",
        fs=7.5,
    )
    return save(fig, out, "ddp_vs_fsdp")


def lora_vs_full(out: Path) -> Path:
    """Chapter 11: a full update trains every number of W; LoRA freezes W and trains B [out, r] and A [r, in]."""
    cfg = LlamaConfig.from_name("llama3-8b")
    n, rank = cfg.dim, 8
    fig, ax = canvas(9.0, 4.0)
    label(ax, 1.8, 3.8, "Full fine-tuning: W changes", fs=9.5, weight="bold")
    box(ax, 0.6, 0.9, 2.4, 2.4, "W\n[out, in]\ntrained", fc=TRAINED, fs=10)
    label(ax, 1.8, 0.45, f"q_proj of Llama-3-8B: {n:,} x {n:,}\n= {n * n:,} numbers trained", fs=8)
    label(ax, 6.0, 3.8, f"LoRA (rank r = {rank}): W frozen, h = W x + (alpha / r) B A x", fs=9.5, weight="bold")
    box(ax, 3.9, 0.9, 2.4, 2.4, "W\n[out, in]\nfrozen", fc=FROZEN, fs=10)
    label(ax, 6.55, 2.1, "+", fs=16)
    label(ax, 7.05, 2.1, "alpha\n-----\n  r", fs=8)
    box(ax, 7.45, 0.9, 0.32, 2.4, "B", fc=TRAINED, fs=9)
    label(ax, 7.85, 1.9, "[out, r]\nstarts at 0", fs=7, ha="left")
    box(ax, 7.95, 2.98, 0.95, 0.32, "A", fc=TRAINED, fs=9)
    label(ax, 8.42, 2.82, "[r, in]\nrandom", fs=7, va="top")
    label(ax, 7.86, 3.14, "x", fs=9)
    trained = rank * (n + n)
    label(
        ax,
        6.6,
        0.45,
        f"the same q_proj: {rank} x ({n:,} + {n:,}) = {trained:,} trained\n"
        f"({100 * trained / (n * n):.2f}% of W); computed as B (A x), never forming B A",
        fs=8,
    )
    return save(fig, out, "lora_vs_full")


def kv_cache(out: Path) -> Path:
    """Chapter 10: prefill fills the cache for the prompt; each decoding step adds one position's keys and values."""
    prompt, steps, max_len = 5, 3, 10
    fig, ax = canvas(9.0, 3.9)
    cw = 0.38
    x0 = 1.9
    label(
        ax,
        x0 + max_len * cw / 2,
        3.65,
        f"the cache of one block: keys and values [batch, kv_heads, max_len = {max_len}, head_dim]",
        fs=8.5,
        weight="bold",
    )
    for p in range(max_len):
        label(ax, x0 + p * cw + cw / 2, 3.3, str(p), fs=7)
    label(ax, x0 - 0.1, 3.3, "position", fs=7, ha="right")
    rows = [("prefill: the prompt", prompt, 0)] + [(f"decoding step {s}", prompt + s, 1) for s in range(1, steps + 1)]
    for r, (name, length, new) in enumerate(rows):
        y = 2.75 - r * 0.55
        label(ax, x0 - 0.1, y + 0.18, name, fs=8, ha="right")
        for p in range(max_len):
            if p < length - (new or length):
                fc, text = CACHE, "kv"
            elif p < length:
                fc, text = TRAINED, "new"
            else:
                fc, text = "white", ""
            cell(ax, x0 + p * cw, y, cw, 0.36, fc, text, fs=6.5, ec=EDGE if p < length else "#bbbbbb")
    legend = [
        (CACHE, "read from the cache"),
        (TRAINED, "computed now, then cached"),
    ]
    for n, (fc, text) in enumerate(legend):
        cell(ax, x0 + max_len * cw + 0.3, 2.6 - n * 0.45, 0.3, 0.25, fc)
        label(ax, x0 + max_len * cw + 0.7, 2.72 - n * 0.45, text, fs=7.5, ha="left")
    label(
        ax,
        x0 + max_len * cw + 0.3,
        1.45,
        "Prefill runs the network on all the\nprompt's tokens at once. "
        "Each later step\nruns it on the one new token, whose\nquery attends to every cached key.",
        fs=7.5,
        ha="left",
        va="top",
    )
    label(ax, 4.5, 0.2, "Without the cache, step n runs the network over all prompt + n tokens again.", fs=8)
    return save(fig, out, "kv_cache")


def nf4_block(out: Path) -> Path:
    """Chapter 12: one block of 64 weights -> a float32 absmax scale and 64 4-bit indices into NF4's 16 levels."""
    rng = np.random.default_rng(0)
    weights = rng.normal(0.0, 0.02, BLOCK)
    scale = np.abs(weights).max()
    levels = NF4.tolist()
    fig, ax = canvas(9.0, 4.4)
    label(ax, 4.5, 4.2, f"NF4: one block of {BLOCK} weights (made-up normal numbers)", fs=9.5, weight="bold")
    cw = 8.4 / BLOCK
    peak = np.abs(weights).argmax()
    cmap = plt.get_cmap("RdBu_r")
    for i, w in enumerate(weights):
        cell(ax, 0.3 + i * cw, 3.45, cw, 0.35, cmap(0.5 + w / scale / 2), ec=RED if i == peak else "#888888")
    label(ax, 0.3 + peak * cw + cw / 2, 3.85, "absmax", fs=7, color=RED, va="bottom")
    box(ax, 6.2, 2.65, 2.5, 0.5, f"scale = max |w| = {scale:.4f}\nkept in float32 (4 bytes)", fs=7.5)
    label(
        ax, 7.45, 2.3, "divide every weight by the scale: now in\n[-1, 1]; keep the index of the nearest level", fs=7.5
    )
    # The number line of NF4's levels, from the package.
    lx0, lx1, ly = 0.6, 8.4, 1.55
    ax.plot([lx0, lx1], [ly, ly], color=EDGE, lw=1)
    for i, v in enumerate(levels):
        x = lx0 + (v + 1) / 2 * (lx1 - lx0)
        ax.plot([x, x], [ly - 0.08, ly + 0.08], color=EDGE, lw=1.2)
        label(ax, x, ly + 0.22, str(i), fs=7)
        if i in (0, 7, 15):
            label(ax, x, ly - 0.25, f"{v:g}", fs=7)
    label(ax, lx0 - 0.1, ly + 0.22, "index", fs=7, ha="right")
    label(ax, lx0 - 0.1, ly - 0.25, "level", fs=7, ha="right")
    for i in (3, 17, int(peak)):  # a few weights to their nearest levels
        v = weights[i] / scale
        nearest = int(np.abs(np.array(levels) - v).argmin())
        arrow(
            ax,
            (0.3 + i * cw + cw / 2, 3.45),
            (lx0 + (levels[nearest] + 1) / 2 * (lx1 - lx0), ly + 0.32),
            color="#777777",
            lw=0.8,
        )
    label(
        ax,
        4.5,
        0.65,
        f"stored: {BLOCK} indices of 4 bits, two a byte = {BLOCK // 2} bytes, plus the 4-byte scale: "
        f"{(BLOCK // 2 + 4) * 8 / BLOCK:g} bits a weight\n(bfloat16: {BLOCK * 2} bytes). Levels are denser near 0, "
        "where normal weights are; 0 is a level (index 7).",
        fs=8,
    )
    return save(fig, out, "nf4_block")


# --- chapter 3 (issue 40) ---


def causal_mask(out: Path) -> Path:
    """Chapter 3: the causal mask of a six-token text; query t reads keys 0..t, the rest get weight exactly 0."""
    words = ["The", "cat", "sat", "on", "the", "mat"]
    n = len(words)
    fig, ax = canvas(9.0, 3.9)
    cw, x0, y0 = 0.42, 1.3, 2.7  # y0: the top row's bottom edge
    label(ax, x0 + n * cw / 2, 3.72, "keys: the tokens looked at", fs=8.5, weight="bold")
    for s, word in enumerate(words):
        label(ax, x0 + s * cw + cw / 2, y0 + cw + 0.12, f"{s}\n{word}", fs=7, va="bottom")
    for t, word in enumerate(words):
        y = y0 - t * cw
        label(ax, x0 - 0.08, y + cw / 2, f"{word} {t}", fs=7, ha="right")
        for s in range(n):
            seen = s <= t
            cell(ax, x0 + s * cw, y, cw, cw, CHANGED if seen else "white", "" if seen else "-inf", fs=6.5)
    label(ax, 0.35, y0 - (n / 2 - 1) * cw, "queries", fs=8.5, weight="bold", rotation=90)
    steps = [
        "scores = q k^T / sqrt(head_dim): every query against every key, [T, T]",
        "masked_fill(~mask, -inf): a key after the query is forbidden (white)",
        "softmax per row: exp(-inf) = 0, so a forbidden key gets weight exactly 0,",
        "and the weights of the keys a query may read (orange) sum to 1",
        "",
        "row t reads keys 0..t: no token sees the ones after it, so predicting",
        "the next token from each position is never cheating, and one pass",
        f"over a text trains all {n} next-token predictions at once",
        "",
        "mask = torch.ones(T, T, dtype=torch.bool).tril()   (lower triangle)",
    ]
    for k, text in enumerate(steps):
        label(ax, 4.3, 3.45 - k * 0.3, text, fs=7.8, ha="left")
    return save(fig, out, "causal_mask")


def padding_masks(out: Path) -> Path:
    """Chapter 3: a 3-token text in a batch of length 5, padded right and left: which keys each query may read."""
    n, width = 3, 5
    fig, ax = canvas(9.0, 4.3)
    cw = 0.4
    for side, x0 in (("right", 0.9), ("left", 5.3)):
        first = 0 if side == "right" else width - n
        real = [first <= c < first + n for c in range(width)]
        positions = [max(c - first, 0) if real[c] else 0 for c in range(width)]
        if side == "right":
            positions = list(range(width))
        names = [f"t{c - first + 1}" if real[c] else "pad" for c in range(width)]
        title = (
            "padded on the right: the causal mask alone"
            if side == "right"
            else "padded on the left: causal AND pads hidden"
        )
        label(ax, x0 + width * cw / 2 + 0.3, 4.15, title, fs=8.5, weight="bold")
        y0 = 3.0
        for s in range(width):
            label(ax, x0 + s * cw + cw / 2, y0 + cw + 0.05, names[s], fs=7, va="bottom")
        for t in range(width):
            y = y0 - t * cw
            label(ax, x0 - 0.08, y + cw / 2, names[t], fs=7, ha="right")
            for s in range(width):
                # left: causal, and no pad key, except a pad's own position (no row of the mask may be empty)
                seen = s <= t if side == "right" else (s <= t and real[s]) or s == t
                hidden_pad = side == "left" and s <= t and not real[s] and s != t
                fc = (CHANGED if real[t] else PAD) if seen else ("#f5c6c0" if hidden_pad else "white")
                cell(ax, x0 + s * cw, y, cw, cw, fc, "pad" if hidden_pad else "", fs=6, color=RED)
            if not real[t]:
                label(ax, x0 + width * cw + 0.08, y + cw / 2, "output unused", fs=6.5, ha="left", color="#777777")
        y_pos = y0 - (width - 1) * cw - 0.22
        label(ax, x0 - 0.08, y_pos, "position", fs=7, ha="right")
        for s in range(width):
            label(ax, x0 + s * cw + cw / 2, y_pos, str(positions[s]), fs=7)
    notes = [
        (
            0.9,
            "The real tokens come first: every key to their left is real,\nso they read exactly the text alone. "
            "The pads' rows\nread real tokens too, but nobody reads the pads' outputs.",
        ),
        (
            5.3,
            "The pads come first: causal alone would let t1..t3 read them\n(red). The padding mask hides pad keys, "
            "and positions count\nfrom each text's first real token: t1 is at position 0 again.",
        ),
    ]
    for x, text in notes:
        label(ax, x - 0.6, 0.45, text, fs=7.5, ha="left")
    legend = [
        (CHANGED, "a real token reads this key"),
        (PAD, "a pad's row"),
        ("#f5c6c0", "a pad key, hidden by the mask"),
        ("white", "after the query: causal"),
    ]
    for k, (fc, text) in enumerate(legend):
        cell(ax, 0.5 + k * 2.15, 3.7, 0.22, 0.18, fc)
        label(ax, 0.8 + k * 2.15, 3.79, text, fs=7, ha="left")
    return save(fig, out, "padding_masks")


def gqa_kv_cache(out: Path) -> Path:
    """Chapter 3: the KV cache of one block of Llama-3-8B, one key head per query head against grouped-query heads."""
    cfg = LlamaConfig.from_name("llama3-8b")
    q, kv, hd, layers = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_layers
    group, tokens = q // kv, 8
    fig, ax = canvas(9.0, 4.4)
    title = f"The keys one block of Llama-3-8B caches for {tokens} tokens (the values: the same again)"
    label(ax, 4.5, 4.2, title, fs=9, weight="bold")
    ch, cw = 0.085, 0.26
    panels = (
        (0.9, q, f"one key head per query head: {q} key heads"),
        (5.4, kv, f"grouped-query: {kv} key heads, each read by {group} query heads"),
    )
    for x0, heads, title in panels:
        top = 3.75
        label(ax, x0 + tokens * cw / 2, top + 0.12, title, fs=8, va="bottom")
        for h in range(heads):  # one row of cells per key head, the same height on both sides
            colour = GROUP_COLOURS[h // group if heads == q else h]
            for p in range(tokens):
                cell(ax, x0 + p * cw, top - (h + 1) * ch, cw, ch, colour, ec="white")
        if heads == kv:  # the outline of what one key head per query head would take
            outline = Rectangle((x0, top - q * ch), tokens * cw, q * ch, fc="none", ec="#999999", lw=1, ls="--")
            ax.add_patch(outline)
            label(ax, x0 + tokens * cw / 2, top - (q + kv) * ch / 2, f"{group}x smaller", fs=10, color="#777777")
        bottom = top - q * ch
        for p in range(tokens):
            label(ax, x0 + p * cw + cw / 2, bottom - 0.12, str(p), fs=6.5)
        label(ax, x0 + tokens * cw / 2, bottom - 0.32, "position: one more column per generated token", fs=7)
        per_token = 2 * layers * heads * hd * cfg.dtype.itemsize
        sizes = (
            f"per token, keys and values of {layers} blocks:\n2 x {layers} x {heads} x {hd} x 2 bytes = "
            f"{per_token // 1024:,} KiB;  8,192 tokens: {per_token * 8192 / 2**30:g} GiB"
        )
        label(ax, x0 + tokens * cw / 2, bottom - 0.7, sizes, fs=7.5)
        label(ax, x0 - 0.08, top - heads * ch / 2, f"{heads} key\nheads", fs=7, ha="right")
    label(
        ax,
        5.4 + tokens * cw + 0.1,
        3.75 - kv * ch / 2,
        f"one row per key head;\nrow g serves query heads\n{group}g to {group}g + {group - 1}",
        fs=7,
        ha="left",
    )
    return save(fig, out, "gqa_kv_cache")


# --- chapter 8 (issue 40) ---


def training_step(out: Path) -> Path:
    """Chapter 8: one optimizer step of your classifier on cached states: forward, loss, backward, update."""
    dim, n_layers, batch = 576, 30, 8  # SmolLM2-135M's width and depth (its config.json), the chapter's batch
    fig, ax = canvas(9.0, 4.6)
    label(ax, 1.75, 4.35, "1. forward", fs=9.5, weight="bold")
    chain = [
        (0.35, f"a batch of cached states [{batch}, T, {dim}]\nand its mask [{batch}, T]", CACHE),
        (1.25, f"block {n_layers - 1}, the last (trained)\n-> [{batch}, T, {dim}]", TRAINED),
        (2.15, f"final RMSNorm (trained), read at each\ntext's last real token -> [{batch}, {dim}]", TRAINED),
        (3.05, f"head (trained): {dim} -> 2\nscores [{batch}, 2]", TRAINED),
    ]
    for y, text, fc in chain:
        box(ax, 0.2, y, 3.1, 0.65, text, fc=fc, fs=8)
    for (y, *_), (y2, *_) in zip(chain, chain[1:], strict=False):
        arrow(ax, (1.75, y + 0.65), (1.75, y2))
    label(ax, 4.95, 4.35, "2. loss", fs=9.5, weight="bold")
    box(ax, 3.8, 3.05, 2.3, 0.65, f"cross-entropy with the\nlabels [{batch}] -> one number", fs=8)
    arrow(ax, (3.3, 3.37), (3.8, 3.37))
    label(ax, 4.95, 2.75, "how wrong the scores are,\naveraged over the batch", fs=7.5, va="top")
    label(ax, 4.95, 1.75, "3. backward", fs=9.5, weight="bold", color=RED)
    arrow(ax, (3.8, 3.2), (3.3, 1.6), color=RED, ls="--", rad=-0.25)
    label(
        ax,
        4.95,
        1.4,
        "loss.backward(): every trained\nweight gets .grad, a tensor of\nits own shape; the cache and\n"
        f"blocks 0-{n_layers - 2} (frozen) get none",
        fs=7.5,
        va="top",
        color=RED,
    )
    label(ax, 7.55, 4.35, "4. update", fs=9.5, weight="bold")
    box(
        ax,
        6.5,
        2.45,
        2.35,
        1.25,
        "optimizer.step(), AdamW:\nw -= lr * (m / (sqrt(v) + eps)\n          + weight_decay * w)\n"
        "m, v: running means of grad\nand grad^2, two more tensors\nthe shape of each weight",
        fs=7.5,
    )
    arrow(ax, (6.1, 3.37), (6.5, 3.37))
    box(ax, 6.5, 1.45, 2.35, 0.65, "optimizer.zero_grad():\nforget this step's .grad", fs=7.5)
    arrow(ax, (7.67, 2.45), (7.67, 2.1))
    arrow(ax, (7.67, 1.45), (3.3, 0.67), rad=-0.15)
    label(ax, 6.3, 0.55, "the next batch", fs=8)
    return save(fig, out, "training_step")


def batch_layout(out: Path) -> Path:
    """Chapter 8: texts sorted by length for the frozen pass; a training batch of cached states, padded, masked."""
    cw, ch = 0.27, 0.27
    fig, ax = canvas(9.0, 4.5)
    label(ax, 2.0, 4.3, "The frozen pass: texts sorted by length", fs=9.5, weight="bold")
    label(ax, 2.0, 4.05, "token ids through blocks 0 .. L-2, once (here 4 texts a batch)", fs=7.5)
    sorted_lengths = [2, 3, 3, 4, 6, 7, 7, 9]  # two batches of four neighbours: little padding
    y = 3.6
    for start in (0, 4):
        batch = sorted_lengths[start : start + 4]
        for length in batch:
            for col in range(max(batch)):
                cell(ax, 0.3 + col * cw, y, cw, ch, PLAIN if col < length else PAD, "" if col < length else "pad", fs=5)
            y -= ch + 0.04
        y -= 0.18
    label(ax, 0.3 + 9 * cw + 0.15, 3.2, "batch 1", fs=7.5, ha="left")
    label(ax, 0.3 + 9 * cw + 0.15, 2.05, "batch 2", fs=7.5, ha="left")
    label(
        ax,
        2.0,
        0.75,
        "neighbours in length order pad little;\n"
        "each text's states are kept without\nits pads: one [length, dim] tensor",
        fs=7.5,
    )
    arrow(ax, (3.2, 2.6), (4.3, 2.6))
    label(ax, 3.75, 2.8, "the cache", fs=7.5)
    label(ax, 6.7, 4.3, "A training batch: cached texts drawn at random", fs=9.5, weight="bold")
    rows = [(3, "ham"), (7, "spam"), (5, "spam"), (2, "ham")]
    width = max(n for n, _ in rows)
    x0 = 5.0
    label(ax, x0 + width * cw / 2, 3.95, "states [4, 7, dim], right-padded", fs=7.5)
    label(ax, x0 + width * cw + 0.75, 3.95, "mask [4, 7]", fs=7.5)
    for r, (n, name) in enumerate(rows):
        y = 3.35 - r * 0.45
        for col in range(width):
            last = col == n - 1
            fc = TRAINED if last else (CACHE if col < n else PAD)
            cell(ax, x0 + col * cw, y, cw, ch, fc, "" if col < n else "pad", fs=5)
        mask = " ".join("1" if col < n else "0" for col in range(width))
        label(ax, x0 + width * cw + 0.1, y + ch / 2, mask, fs=7, ha="left", family="monospace")
        label(ax, x0 - 0.1, y + ch / 2, name, fs=7, ha="right")
    label(
        ax,
        6.7,
        1.35,
        "the mask keeps the pads out of every real token's attention;\n"
        "the head reads position mask.sum(1) - 1 (orange),\n"
        "each text's last real token, the one that has read it all",
        fs=7.5,
    )
    box(ax, 5.4, 0.25, 2.6, 0.5, "last block, final norm, head\n-> scores [4, 2]", fc=TRAINED, fs=7.5)
    arrow(ax, (6.7, 1.0), (6.7, 0.75))
    return save(fig, out, "batch_layout")


FIGURES = [
    llama3_vs_gpt2_block,
    gqa_shapes,
    rope_rotation,
    padding_last_token,
    streaming_load,
    prefix_cache_loop,
    ddp_vs_fsdp,
    lora_vs_full,
    kv_cache,
    nf4_block,
    causal_mask,
    padding_masks,
    gqa_kv_cache,
    training_step,
    batch_layout,
]


def main(argv: list[str] | None = None) -> list[Path]:
    """Draw every figure into the folder named by the first argument (default: this file's folder)."""
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else HERE
    out.mkdir(parents=True, exist_ok=True)
    plt.rcParams.update({"font.family": "DejaVu Sans", "svg.hashsalt": "llama_scratch"})
    np.random.seed(0)
    return [draw(out) for draw in FIGURES]


if __name__ == "__main__":
    for path in main():
        print(f"{path} ({path.stat().st_size // 1024} KiB)")
