"""A per-rank timeline of forward / backward / communication / optimizer spans, written as one
Chrome trace-event JSON file (open it in https://ui.perfetto.dev or chrome://tracing; one row per
rank, the gaps are idle time), and drawn by ``python -m minipar trace-plot out.json [-o schedule.png]``
(:mod:`minipar.plot`).

    trace.start(comm)                    # align the ranks' clocks at a barrier, start recording
    with trace.span("F3", "forward"): ...
    trace.write("out.json", comm)        # rank 0 gathers every rank's events and writes the file

Recording is off until ``start``; a disabled ``span`` costs one attribute check.
"""
from __future__ import annotations

import contextlib
import json
import time
from typing import Any, Iterator

from minipar.safetensors_io import atomic_write

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
