"""--trace writes one Chrome trace for all ranks; trace-plot draws it as ASCII and as a PNG."""
import json
import struct
import subprocess
import sys
import zlib

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
    blob = png.read_bytes()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", blob[16:24])
    assert (width, height) == (1000, 2 * 32 + 4)
    idat = blob[blob.index(b"IDAT") + 4:blob.index(b"IEND") - 8]
    assert len(zlib.decompress(idat)) == height * (1 + 3 * width)


def test_trace_plot_rejects_an_empty_trace(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"traceEvents": []}))
    out = subprocess.run([sys.executable, "-m", "minipar", "trace-plot", str(path)], capture_output=True, text=True)
    assert out.returncode != 0 and "no events" in out.stderr
