"""The command line: training output, loss that falls, checkpoints, generation, bad input."""
import json
import os
import subprocess
import sys

import pytest

from minipar.__main__ import main

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4"]


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "minipar", *args], capture_output=True, text=True, timeout=timeout)


def test_train_json_lines_and_checkpoint(tmp_path, capsys):
    assert main(["train", *TINY, "--steps", "3", "--json", "--eval-interval", "0", "--out", str(tmp_path)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert all({"loss", "lr", "tokens_per_s", "ms", "grad_norm"} <= set(r) for r in lines)
    assert os.path.exists(tmp_path / "model.safetensors") and os.path.exists(tmp_path / "config.json")

    assert main(["generate", "--ckpt", str(tmp_path), "--prompt", "def ", "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out.startswith("def ")


def test_loss_falls_on_default_corpus(capsys):
    args = ["train", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", "8",
            "--steps", "120", "--lr", "3e-3", "--warmup", "10", "--json", "--eval-interval", "0"]
    assert main(args) == 0
    losses = [json.loads(line)["loss"] for line in capsys.readouterr().out.splitlines()]
    assert losses[0] > 5.0  # ≈ ln 256 = 5.55 at initialization
    assert sum(losses[-10:]) / 10 < 3.0


def test_gradient_accumulation_equals_full_batch(capsys):
    """--microbatches 4 must give the same losses as one batch (float64)."""
    outs = []
    for m in ("1", "4"):
        assert main(["train", *TINY, "--steps", "4", "--dtype", "float64", "--microbatches", m, "--json",
                     "--eval-interval", "0"]) == 0
        outs.append([json.loads(line)["loss"] for line in capsys.readouterr().out.splitlines()])
    assert outs[0] == pytest.approx(outs[1], rel=1e-12)


def test_text_progress_line():
    out = run_cli("train", *TINY, "--steps", "2", "--eval-interval", "0")
    assert out.returncode == 0, out.stderr
    step_lines = [line for line in out.stdout.splitlines() if line.startswith("step")]
    assert len(step_lines) == 2 and "loss" in step_lines[0] and "tok/s" in step_lines[0] and "ms" in step_lines[0]


@pytest.mark.parametrize("args,message", [
    (["train", "--n-embd", "30", "--n-head", "4"], "divisible by n_head"),
    (["train", "--data", "/no/such/file"], "data file not found"),
    (["train", "--batch-size", "6", "--microbatches", "4"], "not divisible by --dp·--microbatches"),
    (["train", "--steps", "0"], "--steps must be positive"),
    (["train", "--no-such-flag"], "unrecognized arguments"),
    (["generate", "--ckpt", "/no/such/dir"], "no config.json"),
])
def test_bad_input_is_one_clear_error(args, message):
    out = run_cli(*args)
    assert out.returncode != 0
    assert message in out.stderr and "Traceback" not in out.stderr


def test_help():
    out = run_cli("train", "--help")
    assert out.returncode == 0 and "--microbatches" in out.stdout and "--dtype" in out.stdout
