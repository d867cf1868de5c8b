"""A per-rank timeline of forward / backward / communication / optimizer spans, written as one
Chrome trace-event JSON file (open it in https://ui.perfetto.dev or chrome://tracing; one row per
rank, the gaps are idle time), and drawn as an ASCII chart or a PNG by
``python -m minipar trace-plot out.json [-o schedule.png]``.

    trace.start(comm)                    # align the ranks' clocks at a barrier, start recording
    with trace.span("F3", "forward"): ...
    trace.write("out.json", comm)        # rank 0 gathers every rank's events and writes the file

Recording is off until ``start``; a disabled ``span`` costs one attribute check.
"""
from __future__ import annotations

import contextlib
import json
import struct
import time
import zlib
from typing import Any, Iterator

import numpy as np

from minipar.checkpoint import atomic_write

CATEGORIES = {"forward": ("F", (66, 133, 244)), "backward": ("B", (219, 68, 55)), "comm": ("~", (244, 180, 0)),
              "optimizer": ("o", (15, 157, 88))}
IDLE = (".", (238, 238, 238))


class Tracer:
    def __init__(self) -> None:
        self.enabled = False
        self.events: list[dict[str, Any]] = []
        self.t0 = 0.0
        self.rank = 0

    def start(self, comm: Any) -> None:
        comm.barrier()  # on one machine perf_counter is one clock; the barrier makes t = 0 common
        self.t0, self.rank, self.enabled, self.events = time.perf_counter(), comm.rank, True, []

    @contextlib.contextmanager
    def span(self, name: str, category: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self.events.append({"name": name, "cat": category, "ph": "X", "pid": self.rank, "tid": 0,
                                "ts": (start - self.t0) * 1e6, "dur": (end - start) * 1e6})

    def write(self, path: str, comm: Any) -> None:
        """Gather every rank's events on rank 0 and write them as one Chrome trace (all ranks must call)."""
        gathered = comm.all_gather_bytes(json.dumps(self.events).encode(), label="trace")
        if comm.rank == 0:
            events = [e for blob in gathered for e in json.loads(blob.decode())]
            names = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}} for r in range(comm.size)]
            atomic_write(path, [json.dumps({"traceEvents": names + events, "displayTimeUnit": "ms"}).encode()])


tracer = Tracer()  # one per process
span = tracer.span
start = tracer.start
write = tracer.write


# ---------------------------------------------------------------------------------------- plotting


def load_events(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X"]


def _grid(events: list[dict[str, Any]], width: int) -> tuple[list[list[str]], float]:
    """Per rank, one category name (or None: idle) per time bin; and the span of time covered."""
    ranks = sorted({e["pid"] for e in events})
    t_end = max(e["ts"] + e["dur"] for e in events)
    rows = {r: [None] * width for r in ranks}
    for e in sorted(events, key=lambda e: e["dur"], reverse=True):  # short spans drawn over long ones
        a, b = int(e["ts"] / t_end * width), int((e["ts"] + e["dur"]) / t_end * width)
        for i in range(a, max(a + 1, b)):
            rows[e["pid"]][min(i, width - 1)] = e["cat"]
    return [rows[r] for r in ranks], t_end


def ascii_chart(events: list[dict[str, Any]], width: int = 100) -> str:
    """One line per rank: F forward, B backward, ~ communication, o optimizer, . idle."""
    grid, t_end = _grid(events, width)
    lines = [f"rank {r:>2} |" + "".join(CATEGORIES.get(c, IDLE)[0] for c in row) + "|" for r, row in enumerate(grid)]
    legend = "  ".join(f"{sym} {cat}" for cat, (sym, _) in CATEGORIES.items()) + f"  {IDLE[0]} idle"
    busy = [sum(c in ("forward", "backward") for c in row) / width for row in grid]
    return "\n".join([f"timeline: {t_end / 1e3:.1f} ms across {width} columns; {legend}", *lines,
                      "compute share per rank: " + ", ".join(f"{b:.0%}" for b in busy)])


def png_chart(events: list[dict[str, Any]], path: str, width: int = 1000, row_height: int = 28) -> None:
    """The same chart as a PNG, written with zlib alone (PNG = signature + IHDR + IDAT + IEND chunks)."""
    grid, _ = _grid(events, width)
    gap = 4
    height = len(grid) * (row_height + gap) + gap
    image = np.full((height, width, 3), 255, np.uint8)
    for r, row in enumerate(grid):
        top = gap + r * (row_height + gap)
        colors = np.array([CATEGORIES.get(c, IDLE)[1] for c in row], np.uint8)
        image[top:top + row_height] = colors[None, :, :]
    raw = b"".join(b"\x00" + image[y].tobytes() for y in range(height))  # filter type 0 per scanline

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    atomic_write(path, [png])
