"""--trace writes one Chrome trace for all ranks; trace-plot draws it as text and as a picture;
plot draws the loss curves of several runs."""
import json
import subprocess
import sys
import types

from minipar.__main__ import main
from minipar.testing import run_command


def test_trace_and_plot(tmp_path):
    path = tmp_path / "t.json"
    run_command(2, [sys.executable, "-m", "minipar", "train", "--pp", "2", "--microbatches", "4", "--n-layer", "2",
                    "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--batch-size", "8", "--steps", "2",
                    "--eval-interval", "0", "--trace", str(path)], timeout=120)
    events = json.load(open(path))["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    for rank in (0, 1):  # 2 steps × 4 microbatches, forward and backward, on every stage
        assert sum(e["cat"] == "forward" and e["pid"] == rank for e in spans) == 8
        assert sum(e["cat"] == "backward" and e["pid"] == rank for e in spans) == 8
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)

    png = tmp_path / "schedule.png"
    out = subprocess.run([sys.executable, "-m", "minipar", "trace-plot", str(path), "-o", str(png), "--width", "60"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("rank")]
    assert len(rows) == 2 and all("F" in r and "B" in r and len(r) == len("rank  0 |") + 60 + 1 for r in rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = tmp_path / "schedule.svg"  # the same picture with its text kept as text: legend, rank labels, time axis
    assert main(["trace-plot", str(path), "-o", str(svg)]) == 0
    text = svg.read_text()
    assert all(label in text for label in ("rank 0", "rank 1", "time (ms)", "forward", "backward", "comm"))


def test_plot_loss_curves_of_several_runs(tmp_path, capsys):
    tiny = ["train", "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
            "--steps", "6", "--json", "--eval-interval", "3", "--eval-batches", "1"]
    for name, lr in (("slow", "1e-4"), ("fast", "3e-3")):
        assert main([*tiny, "--lr", lr]) == 0
        (tmp_path / f"{name}.jsonl").write_text(capsys.readouterr().out)
    svg = tmp_path / "loss.svg"
    assert main(["plot", str(tmp_path / "slow.jsonl"), str(tmp_path / "fast.jsonl"), "-o", str(svg)]) == 0
    out = capsys.readouterr().out
    assert "slow: 6 steps" in out and "fast: 6 steps" in out and "best val loss" in out
    assert "* slow" in out and "o fast" in out  # the text chart's legend
    text = svg.read_text()
    assert all(label in text for label in ("slow", "fast (validation)", "step", "loss"))


def test_plot_rejects_a_file_without_losses(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("hello\n")
    out = subprocess.run([sys.executable, "-m", "minipar", "plot", str(path)], capture_output=True, text=True)
    assert out.returncode == 2 and "no loss records" in out.stderr


def test_trace_plot_rejects_an_empty_trace(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"traceEvents": []}))
    out = subprocess.run([sys.executable, "-m", "minipar", "trace-plot", str(path)], capture_output=True, text=True)
    assert out.returncode != 0 and "no events" in out.stderr


def test_trace_plot_draws_weight_passes_of_zero_bubble(tmp_path):
    path, svg = tmp_path / "zb.json", tmp_path / "zb.svg"
    run_command(2, [sys.executable, "-m", "minipar", "train", "--pp", "2", "--schedule", "zb-h1", "--microbatches",
                    "4", "--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--batch-size", "8",
                    "--steps", "1", "--eval-interval", "0", "--trace", str(path)], timeout=120)
    spans = [e for e in json.load(open(path))["traceEvents"] if e["ph"] == "X"]
    for rank in (0, 1):  # 4 microbatches: F, B (input gradients) and W (weights) each, on every stage
        assert [sum(e["cat"] == c and e["pid"] == rank for e in spans) for c in ("forward", "backward", "weights")] == [4] * 3
    out = subprocess.run([sys.executable, "-m", "minipar", "trace-plot", str(path), "--width", "80"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "W weights" in out.stdout, out.stderr
    assert all("W" in line for line in out.stdout.splitlines() if line.startswith("rank"))
    assert main(["trace-plot", str(path), "-o", str(svg)]) == 0 and "weights" in svg.read_text()


def test_a_span_records_microseconds_since_start(monkeypatch, tmp_path):
    """On a clock that reads 10.0 at start, 10.5 and 10.75 around a span: ts 500000 µs, dur 250000 µs, on the rank's
    row (pid) and thread 0. Before start nothing is recorded (a run without --trace keeps no events). Rank 0 alone
    writes the file: every rank's events after a row name per rank."""
    from minipar import trace

    readings = iter([10.0, 10.5, 10.75])
    monkeypatch.setattr(trace, "time", types.SimpleNamespace(perf_counter=lambda: next(readings)))
    tracer = trace.Tracer()
    with tracer.span("F0", "forward"):
        pass
    assert tracer.events == []
    tracer.start(types.SimpleNamespace(rank=3, barrier=lambda: None))
    with tracer.span("F0", "forward"):
        pass
    event = {"name": "F0", "cat": "forward", "ph": "X", "pid": 3, "tid": 0, "ts": 500000.0, "dur": 250000.0}
    assert tracer.events == [event]
    path = tmp_path / "t.json"
    for rank in (1, 0):
        tracer.write(str(path), types.SimpleNamespace(rank=rank, size=2, all_gather_bytes=lambda blob, label: [b"[]", blob]))
        assert path.exists() == (rank == 0)
    names = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}} for r in (0, 1)]
    assert json.load(open(path)) == {"traceEvents": [*names, event], "displayTimeUnit": "ms"}
