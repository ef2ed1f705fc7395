"""The report's plots (matplotlib): each ``*_figure`` builds a figure a test can inspect, and the HTML embeds it.

Curves are PNG images. The memory plot is inline SVG with its text kept as text, so the browser lays the
capacity labels out itself and a test can read their boxes from the DOM (``id="capacity-label-N"``).
"""
from __future__ import annotations

import base64
import html
import io
import math
import re
from collections.abc import Sequence

from ..ledger.records import GateRow, RunStatus, Series
from ..ledger.store import Ledger

# Line styles per seed. Dashes are kept for retries (RETRY_DASH) so a retry never looks like a seed of its parent.
SEED_STYLES = ["-", ":", "-.", (0, (1, 1.5, 5, 1.5))]
RETRY_DASH = (0, (6, 2.5))
LINE_WIDTH, RETRY_WIDTH = 1.5, 2.2
# Tick mantissas per decade, coarse to fine: the first set that leaves no large unlabelled stretch is used.
NICE_MANTISSAS = ((1.0,), (1.0, 2.0, 5.0), (1.0, 2.0, 3.0, 5.0, 7.0), tuple(float(m) for m in range(1, 10)),
                  (1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0), tuple(m / 10 for m in range(10, 100)))
# The largest stretch at either end of the axis (share of its log span) left without a labelled tick: a diverged
# run's points sit at the top end, and were read off an axis with no number near them. Between ticks a wider gap
# (a 1-2-5 step) reads fine.
MAX_UNLABELLED, MAX_INNER_GAP = 0.2, 0.4


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    return f'<img alt="plot" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def inline_svg(fig, alt: str) -> str:
    """The figure as an inline ``<svg>`` whose text stays text (the browser draws it; tests can measure it)."""
    plt = pyplot()
    buf = io.StringIO()
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "pilotrun"}):
        fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]  # drop the XML declaration and DOCTYPE: not allowed inside HTML
    svg = re.sub(r'<svg([^>]*?) width="[^"]*" height="[^"]*"', r'<svg\1 role="img" aria-label="' + html.escape(alt)
                 + r'" style="max-width:100%;height:auto"', svg, count=1)
    return f'<div class="plot">{svg}</div>'


# -- pilot ---------------------------------------------------------------------------------------------------------

def memory_figure(stages: Sequence[GateRow], capacities: dict[str, int]):
    """Peak allocated/reserved per stage (log GiB) and a dashed line per accelerator's capacity, labelled above the
    axes; labels that would overlap (A100 and H100 are both ~79 GiB) go to rows further up."""
    plt = pyplot()
    labels = [r.gate + (f" (rank {r.rank})" if r.world_size > 1 else "") for r in stages]
    alloc = [r.memory["peak_allocated_bytes"] / 2**30 for r in stages]
    resv = [(r.memory.get("peak_reserved_bytes") or 0) / 2**30 for r in stages]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(stages) + 1.6))
    y = range(len(stages))
    ax.barh([i + 0.2 for i in y], alloc, height=0.4, label="peak allocated", color="#1a73e8")
    if any(resv):
        ax.barh([i - 0.2 for i in y], resv, height=0.4, label="peak reserved", color="#8ab4f8")
    for cap in capacities.values():
        ax.axvline(cap / 2**30, linestyle="--", linewidth=1, color="#c5221f")
    ax.set_xscale("log")
    ax.set_yticks(list(y))
    ax.set_yticklabels(labels)
    ax.invert_yaxis()
    ax.set_xlabel("GiB (log scale); dashed: capacity per device as the runtime reports it")
    ax.legend(loc="lower right", fontsize=8)
    _place_capacity_labels(fig, ax, capacities)
    return fig


def _place_capacity_labels(fig, ax, capacities: dict[str, int], pad_px: float = 6.0) -> None:
    """Each label above the axes, ending at its line, in the lowest row where it overlaps no label or connector
    already placed and its own connector crosses no label: greedy packing in display space, measured with the
    renderer (``pad_px`` leaves room for the browser's own font metrics). Going from the smallest capacity up, every
    label already placed ends left of the current line, so a new row on top always fits: nothing overlaps."""
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    top = ax.get_window_extent(renderer).y1
    texts: list = []  # label boxes as drawn
    wires: list = []  # thin boxes along each placed connector
    rows_used = 0
    for i, (name, cap) in enumerate(sorted(capacities.items(), key=lambda kv: kv[1])):
        x = cap / 2**30
        for row in range(rows_used + 1):
            note = ax.annotate(f"{name}: {x:.1f} GiB", xy=(x, 1.0), xycoords=("data", "axes fraction"),
                               xytext=(-2, 4 + 11 * row), textcoords="offset points", ha="right", va="bottom",
                               fontsize=7, color="#c5221f", annotation_clip=False,
                               arrowprops={"arrowstyle": "-", "color": "#c5221f", "linewidth": 0.6, "shrinkA": 0,
                                           "shrinkB": 0, "relpos": (1.0, 0.0)})
            note.update_positions(renderer)  # what Annotation.get_window_extent does first
            box = Text.get_window_extent(note, renderer)  # the text alone (the Annotation's box holds its connector)
            line_x = ax.transData.transform((x, 1.0))[0]
            wire = Bbox([[line_x - 0.5, top], [line_x + 0.5, box.y0]])
            padded = box.padded(pad_px / 2)
            if row == rows_used or (not any(padded.overlaps(b) for b in texts + wires)
                                    and not any(wire.overlaps(b) for b in texts)):
                break
            note.remove()
        rows_used = max(rows_used, row + 1)
        note.set_gid(f"capacity-label-{i}")
        texts.append(box)
        wires.append(wire)


def curve_figure(points: list[tuple[int, float]], title: str, ylabel: str):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", color="#1a73e8")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("update")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig


# -- campaign ------------------------------------------------------------------------------------------------------

def _value(m: dict, field: str) -> float | None:
    if field == "throughput":
        # tokens/s for sequence models, examples/s otherwise: whichever the worker counted.
        n = m.get("tokens") or m.get("examples")
        return n / m["seconds"] if n and m.get("seconds") else None
    return m.get(field)


def _short_id(run_id: str) -> str:
    return run_id.rsplit("-", 1)[-1]


def is_retry(run: dict) -> bool:
    """A retry is a new run linked to the one it retried (a resumed run continues the same one: same style)."""
    return bool(run.get("parent_id")) and not run["meta"].get("continues")


def run_style(runs: list[dict], key: str):
    """One colour per variant, one line style per seed: the same run looks the same in every plot. A retry is
    dashed and darker, and its legend entry names the run it retried and what it changed."""
    from matplotlib.colors import to_rgb

    plt = pyplot()
    order = [str(x["meta"].get("variant")) for x in runs]
    variants = sorted(set(order), key=order.index)
    seeds = sorted({r["meta"].get("seed") for r in runs}, key=str)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def style(r: dict) -> dict:
        v = str(r["meta"].get("variant"))
        color = colors[variants.index(v) % len(colors)]
        label = f"{_short_id(r['run_id'])} {key}={v}, seed {r['meta'].get('seed')}"
        if r.get("parent_id") and r["meta"].get("continues"):
            label += f" (resumed {_short_id(r['parent_id'])})"
        if r["status"] != RunStatus.FINISHED:
            label += f" ({r['status']})"
        seed = r["meta"].get("seed")
        out = {"color": color, "label": label, "linewidth": LINE_WIDTH,
               "linestyle": SEED_STYLES[seeds.index(seed) % len(SEED_STYLES)] if seed in seeds else "-"}
        if is_retry(r):
            changed = ", ".join(f"{k.rsplit('.', 1)[-1]} {val}" for k, val in (r["meta"].get("changes") or {}).items())
            out.update(color=tuple(0.62 * c for c in to_rgb(color)), linestyle=RETRY_DASH, linewidth=RETRY_WIDTH,
                       label=f"{label}: retry of {_short_id(r['parent_id'])}" + (f" ({changed})" if changed else ""))
        return out
    return style


def log_ticks(lo: float, hi: float) -> list[float]:
    """Plain-number ticks for a log axis from ``lo`` to ``hi``: the coarsest 'nice' set (1-2-5, 1..9, ...) that
    leaves neither end more than :data:`MAX_UNLABELLED` of the span from a labelled tick (the finest set when
    none does)."""
    span = math.log10(hi / lo) or 1.0
    ticks: list[float] = []
    for mantissas in NICE_MANTISSAS:
        ticks = sorted({round(m * 10.0**e, 12) for e in range(math.floor(math.log10(lo)) - 1,
                                                               math.ceil(math.log10(hi)) + 1)
                        for m in mantissas if lo <= m * 10.0**e <= hi})
        if len(ticks) < 2:
            continue
        ends = (math.log10(ticks[0] / lo), math.log10(hi / ticks[-1]))
        inner = max(math.log10(b / a) for a, b in zip(ticks, ticks[1:]))
        if max(ends) <= MAX_UNLABELLED * span and inner <= MAX_INNER_GAP * span:
            break
    if len(ticks) < 2:  # a span under 1% (a flat curve): both ends and the middle, in as few digits as tell them apart
        for digits in range(3, 10):
            ticks = sorted({float(f"{v:.{digits}g}") for v in (lo, math.sqrt(lo * hi), hi)})
            if len(ticks) == 3:
                break
    return ticks


def plain_log_axis(ax) -> None:
    """Log scale with 2, 3, 5, 10 on the axis instead of 2 x 10^0, and a labelled tick near every end."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    ax.yaxis.set_major_locator(FixedLocator(log_ticks(lo, hi)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(lo, hi)


def campaign_figure(led: Ledger, runs: list[dict], key: str, series: Series, title: str):
    """Loss per update for every run (None when no run has a point)."""
    plt = pyplot()
    style = run_style(runs, key)
    fig, ax = plt.subplots(figsize=(9, 4.2))
    drawn = 0
    for r in runs:
        pts = [(m["step"], m["loss"]) for m in led.metrics(r["run_id"], series) if m["loss"] is not None]
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if series == Series.VAL else None, alpha=0.9,
                **style(r))
        # Mark where a run diverged on its training curve (its last validation point is not where it diverged).
        if r["status"] == RunStatus.DIVERGED and series == Series.TRAIN:
            ax.plot([pts[-1][0]], [pts[-1][1]], marker="x", markersize=10, color="#c5221f")
        drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    plain_log_axis(ax)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("update")
    ax.set_ylabel("loss (log scale)")
    ax.grid(alpha=0.3)
    # Below the axes: inside, it hides exactly the diverging curves people need to see.
    ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    return fig


def dynamics_figure(led: Ledger, runs: list[dict], key: str):
    """Learning rate, gradient norm and throughput per update (None when nothing was recorded)."""
    plt = pyplot()
    style = run_style(runs, key)
    panels = (("lr", "learning rate (log scale)", True), ("grad_norm", "gradient norm (log scale)", True),
              ("throughput", "throughput (tokens or examples / s)", False))
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    drawn = 0
    for r in runs:
        metrics = led.metrics(r["run_id"], Series.TRAIN)
        for ax, (field, _, _) in zip(axes, panels):
            pts = [(m["step"], v) for m in metrics if (v := _value(m, field)) is not None]
            if pts:
                s = style(r)
                s["linewidth"] *= 0.8  # three small panels: thinner than the loss plot's lines
                ax.plot([p[0] for p in pts], [p[1] for p in pts], alpha=0.85, **s)
                drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    for ax, (_, title, log) in zip(axes, panels):
        if log and ax.has_data():
            ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("update", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, 0.0), frameon=False)
    fig.tight_layout()
    return fig
