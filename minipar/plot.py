"""Pictures of a run: the per-rank timeline of ``train --trace`` and the loss curves of ``train --json``.

Text charts need nothing beyond the standard library and are always printed; PNG files are drawn
with matplotlib, an optional extra (``pip install 'minipar[plot]'``).

    python -m minipar trace-plot out.json [-o schedule.png]        # F/B/W/~/o per rank over time
    python -m minipar plot a.jsonl b.jsonl [-o loss.png]           # several runs on one chart
"""
from __future__ import annotations

import json
import os
from typing import Any

from minipar.safetensors_io import atomic_write

# category: (symbol in text charts, colour in pictures)
CATEGORIES = {"forward": ("F", "#4285f4"), "backward": ("B", "#db4437"), "weights": ("W", "#ab47bc"),
              "comm": ("~", "#f4b400"), "optimizer": ("o", "#0f9d58")}
IDLE = (".", "#eeeeee")
RUN_SYMBOLS = "*o+x#@%&"


def pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("drawing a PNG needs matplotlib: pip install 'minipar[plot]' "
                           "(the text chart above needs nothing)") from None
    matplotlib.use("Agg")  # files only, no display
    matplotlib.rcParams["svg.fonttype"] = "none"  # an .svg keeps its labels as text
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure: Any, path: str) -> None:
    """Render to memory, write atomically (a reader never sees half a PNG), and close the figure (pyplot keeps every
    open one alive)."""
    import io

    buffer = io.BytesIO()
    figure.savefig(buffer, format=os.path.splitext(path)[1][1:] or "png", dpi=120, bbox_inches="tight")
    atomic_write(path, [buffer.getvalue()])
    pyplot().close(figure)


# ------------------------------------------------------------------------------------- timelines


def load_events(path: str) -> list[dict[str, Any]]:
    """The complete-duration ("X") events of a Chrome trace written by ``--trace``."""
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a trace JSON file ({e})") from None
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X"]


def _grid(events: list[dict[str, Any]], width: int) -> tuple[list[list[str | None]], float]:
    """Per rank, one category name (or None: idle) per time bin; and the span of time covered."""
    ranks = sorted({e["pid"] for e in events})
    t_end = max(e["ts"] + e["dur"] for e in events)
    rows: dict[int, list[str | None]] = {r: [None] * width for r in ranks}
    for e in sorted(events, key=lambda e: e["dur"], reverse=True):  # short spans drawn over long ones
        a, b = int(e["ts"] / t_end * width), int((e["ts"] + e["dur"]) / t_end * width)
        for i in range(a, max(a + 1, b)):
            rows[e["pid"]][min(i, width - 1)] = e["cat"]
    return [rows[r] for r in ranks], t_end


def ascii_chart(events: list[dict[str, Any]], width: int = 100) -> str:
    """One line per rank: F forward, B backward (input gradients only under zb-h1), W weight gradients,
    ~ communication, o optimizer, . idle."""
    grid, t_end = _grid(events, width)
    lines = [f"rank {r:>2} |" + "".join(CATEGORIES.get(c, IDLE)[0] for c in row) + "|" for r, row in enumerate(grid)]
    legend = "  ".join(f"{sym} {cat}" for cat, (sym, _) in CATEGORIES.items()) + f"  {IDLE[0]} idle"
    busy = [sum(c in ("forward", "backward", "weights") for c in row) / width for row in grid]
    return "\n".join([f"timeline: {t_end / 1e3:.1f} ms across {width} columns; {legend}", *lines,
                      "compute share per rank: " + ", ".join(f"{b:.0%}" for b in busy)])


def timeline_png(events: list[dict[str, Any]], path: str) -> None:
    """Each span as a bar on its rank's row, coloured by category; time in ms; legend and rank labels."""
    plt = pyplot()
    ranks = sorted({e["pid"] for e in events})
    figure, axes = plt.subplots(figsize=(12, 0.6 * len(ranks) + 1.4))
    for category, (_, colour) in CATEGORIES.items():
        label = category  # once per category, in the legend
        for row, rank in enumerate(ranks):
            spans = [(e["ts"] / 1e3, e["dur"] / 1e3) for e in events if e["pid"] == rank and e["cat"] == category]
            if spans:
                axes.broken_barh(spans, (row - 0.4, 0.8), facecolors=colour, label=label)
                label = None
    axes.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    axes.invert_yaxis()
    axes.set_xlabel("time (ms)")
    axes.set_title("per-rank timeline (gaps: idle)")
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(ranks) < 4 else -0.12), ncol=len(CATEGORIES))
    save_figure(figure, path)


# ----------------------------------------------------------------------------------- loss curves


def load_run(path: str) -> dict[str, list[tuple[int, float]]]:
    """{"loss": [(step, loss)...], "val_loss": [...]} from a ``--json`` output or ``--log-file``
    (lines that are not JSON objects, such as a launcher's, are skipped)."""
    curves: dict[str, list[tuple[int, float]]] = {"loss": [], "val_loss": []}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.startswith("{"):
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not a JSON record ({e})") from None
            for key in curves:
                if isinstance(record.get(key), (int, float)):
                    curves[key].append((record["step"], float(record[key])))
    if not curves["loss"] and not curves["val_loss"]:
        raise ValueError(f"{path}: no loss records (write one with: train --json > run.jsonl, or --log-file)")
    return curves


def ascii_loss_chart(runs: dict[str, dict[str, list[tuple[int, float]]]], width: int = 72, height: int = 16) -> str:
    """Training loss against step, one symbol per run, on a shared grid."""
    points = {name: curve["loss"] for name, curve in runs.items() if curve["loss"]}
    if not points:
        return "no training-loss records to draw"
    steps = [s for curve in points.values() for s, _ in curve]
    losses = [v for curve in points.values() for _, v in curve]
    s0, s1, lo, hi = min(steps), max(steps), min(losses), max(losses)
    grid = [[" "] * width for _ in range(height)]
    for symbol, curve in zip(RUN_SYMBOLS, points.values()):
        for s, v in curve:
            col = round((s - s0) / max(s1 - s0, 1) * (width - 1))
            row = round((hi - v) / max(hi - lo, 1e-12) * (height - 1))
            grid[row][col] = symbol
    lines = [f"{hi - (hi - lo) * r / (height - 1):8.3f} |" + "".join(row) for r, row in enumerate(grid)]
    lines.append(" " * 9 + "+" + "-" * width)
    lines.append(" " * 10 + f"step {s0}" + " " * max(1, width - 10 - len(str(s0)) - len(str(s1))) + f"step {s1}")
    lines += [f"  {symbol} {name}" for symbol, name in zip(RUN_SYMBOLS, points)]
    return "\n".join(lines)


def summary(runs: dict[str, dict[str, list[tuple[int, float]]]]) -> str:
    rows = []
    for name, curve in runs.items():
        loss, val = curve["loss"], curve["val_loss"]
        text = f"{name}: {len(loss)} steps"
        if loss:
            text += f", loss {loss[0][1]:.4f} -> {loss[-1][1]:.4f}"
        if val:
            text += f", best val loss {min(v for _, v in val):.4f}"
        rows.append(text)
    return "\n".join(rows)


def loss_png(runs: dict[str, dict[str, list[tuple[int, float]]]], path: str) -> None:
    """Training loss (solid) and validation loss (dashed, same colour) of every run against step."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(8, 5))
    for name, curve in runs.items():
        line = None
        if curve["loss"]:
            (line,) = axes.plot(*zip(*curve["loss"]), label=f"{name}")
        if curve["val_loss"]:
            axes.plot(*zip(*curve["val_loss"]), "--o", markersize=3, label=f"{name} (validation)",
                      color=line.get_color() if line else None)
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats per token)")
    axes.grid(alpha=0.3)
    axes.legend()
    save_figure(figure, path)
