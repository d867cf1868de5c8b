"""The training CLI under faults: an error on one rank ends the whole job within seconds, with one line
naming the rank and no temporary files left; a diverged run stops with an error and saves nothing;
SIGINT and SIGTERM finish the step, checkpoint and stop; a stalled rank ends the job within --comm-timeout;
ranks started with different flags or data refuse to start; errors every rank shares are printed once."""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from minipar.checkpoint import load_checkpoint
from minipar.testing import RANK_ENV, mpiexec, run_command

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
        "--eval-batches", "1", "--warmup", "2"]
FAULT_SECONDS = 20  # start-up, the 3 s agreement window, MPI_Abort: far below a hang


def _train(ranks, args, timeout=120):
    return run_command(ranks, [sys.executable, "-m", "minipar", "train", *TINY, *args], timeout=timeout)


def _no_temporaries(root):
    return not glob.glob(os.path.join(str(root), "**", "*.tmp-*"), recursive=True)


@pytest.mark.parametrize("ranks,layout", [(2, ["--pp", "2"]), (3, ["--dp", "3", "--batch-size", "6"])])
@pytest.mark.parametrize("phase", ["startup", "step", "evaluation", "checkpoint-write", "checkpoint-load"])
def test_a_fault_on_one_rank_ends_the_job_in_seconds(tmp_path, phase, ranks, layout):
    save = tmp_path / "ckpt"
    args = [*layout, "--steps", "4", "--eval-interval", "2", "--save", str(save), "--save-interval", "2"]
    if phase == "checkpoint-load":
        _train(ranks, [*layout, "--steps", "2", "--save", str(save), "--eval-interval", "0"])
        args += ["--resume", str(save)]
    faulty = 0 if phase == "checkpoint-write" and "--dp" in layout else 1  # under dp only dp rank 0 writes
    command = [sys.executable, os.path.join(HERE, "helpers", "faulty_train.py"), phase, str(faulty), "--", *TINY, *args]
    start = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        run_command(ranks, command, timeout=FAULT_SECONDS)
    elapsed, report = time.monotonic() - start, str(failure.value)
    assert "timed out" not in report, report
    assert elapsed < FAULT_SECONDS
    assert f"minipar train: error on rank {faulty} of {ranks}:" in report and "injected fault" in report, report
    assert report.count("error on rank") == 1 and "Traceback" not in report
    assert _no_temporaries(tmp_path)


@pytest.mark.slow  # 4 s: the full suite; the fast subset keeps the one-rank fault ending the job in seconds
def test_the_reported_checkpoint_hang_is_gone(tmp_path):
    """A directory where rank 1's shard belongs (the issue's reproduction): one line, no hang, no .tmp file."""
    os.makedirs(tmp_path / "ckx" / "step_000002" / "pp1-tp0.safetensors")
    with pytest.raises(AssertionError) as failure:
        _train(2, ["--pp", "2", "--steps", "2", "--save", str(tmp_path / "ckx"), "--eval-interval", "0"],
               timeout=FAULT_SECONDS)
    report = str(failure.value)
    assert "error on rank 1 of 2: checkpoint: cannot write " in report and "timed out" not in report
    assert "pp1-tp0.safetensors (Is a directory); the checkpoints written before it are kept" in report
    assert _no_temporaries(tmp_path)


def _strict_json(line):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(line, parse_constant=refuse)


@pytest.mark.parametrize("ranks", [1, 2])
def test_divergence_stops_with_an_error_and_saves_nothing(tmp_path, ranks):
    out, save = tmp_path / "out", tmp_path / "save"
    command = [sys.executable, "-m", "minipar", "train", *TINY, "--lr", "1e6", "--steps", "30", "--json",
               "--eval-interval", "0", "--out", str(out), "--save", str(save), "--save-interval", "1",
               *(["--dp", "2"] if ranks > 1 else [])]
    if ranks > 1:
        command = [mpiexec(), "-n", str(ranks), *command]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, **RANK_ENV})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("training diverged") == 1 and "not finite" in proc.stderr
    assert "RuntimeWarning" not in proc.stderr  # the one line, not numpy's warnings ahead of it
    records = [_strict_json(line) for line in proc.stdout.splitlines()]  # every line is valid JSON
    bad = records[-1]
    assert bad["loss"] is None or bad["grad_norm"] is None
    assert len(records) < 30 and not out.exists()
    saved = sorted(os.listdir(save)) if save.exists() else []
    assert f"step_{bad['step']:06d}" not in saved  # the diverged step was never checkpointed
    for step_dir in saved:
        if step_dir.startswith("step_"):
            params = load_checkpoint(str(save / step_dir)).params
            assert all(float(abs(v).max()) < float("inf") for v in params.values())


def _rank_pids(marker):
    """The pids of the rank processes (not mpiexec) whose command line contains ``marker``."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if marker.encode() in cmdline and os.path.basename(cmdline[0]).startswith(b"python"):
            pids.append(int(pid))
    return pids


@pytest.mark.parametrize("ranks,how,save", [(1, "SIGTERM", True), (2, "SIGTERM", True), (1, "SIGINT", True),
                                            (2, "SIGINT", True), (2, "SIGINT", False)])
def test_interrupt_finishes_the_step_checkpoints_and_stops(tmp_path, ranks, how, save):
    """SIGTERM to one rank (a node's preemption notice) or SIGINT to the whole process group (Ctrl-C in a
    terminal): every rank finishes the same step, one checkpoint of it is written (with --save), one line says
    so — once, not per rank — and the exit status is 128 + the signal; never a traceback."""
    where = str(tmp_path / "save")
    command = [sys.executable, "-m", "minipar", "train", *TINY, "--steps", "100000", "--json", "--eval-interval", "0",
               "--log-file", str(tmp_path / "run.jsonl"), *(["--save", where] if save else []),
               *(["--dp", "2"] if ranks > 1 else [])]
    if ranks > 1:
        command = [mpiexec(), "-n", str(ranks), *command]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, **RANK_ENV})
    signum = getattr(signal, how)
    try:
        first = proc.stdout.readline()
        assert _strict_json(first)["step"] == 1
        pids = _rank_pids(str(tmp_path / "run.jsonl"))
        assert len(pids) == ranks
        if how == "SIGTERM":
            os.kill(pids[-1], signum)  # one rank only
        else:
            os.killpg(proc.pid, signum)  # the terminal's Ctrl-C reaches the whole foreground group
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signum, err
    # mpiexec writes its own Ctrl-C notes into the same stdout and can cut a record line in two: read the records
    # that arrived whole; the step comes from the one "interrupted" line
    lines = [line.strip() for line in [first, *out.splitlines()]]
    records = [json.loads(line) for line in lines if line.startswith("{") and line.endswith("}")]
    assert err.count("interrupted") == 1 and f"({how})" in err, err
    last = int(err.split("interrupted at step ")[1].split()[0])
    assert last - 1 <= records[-1]["step"] <= last  # the step it stopped after was the last one printed (or cut)
    line = f"interrupted at step {last} ({how})" + (f"; checkpoint saved to {where}/step_{last:06d}" if save else "")
    assert line in err, err
    assert "Traceback" not in err
    if save:
        assert load_checkpoint(where).step == last
        assert _no_temporaries(where)


def test_a_stalled_rank_ends_the_job(tmp_path):
    """A rank stopped mid-run (SIGSTOP): within --comm-timeout the rank waiting for it names the collective and the
    silent rank, and the job ends (MPI_Abort) instead of hanging."""
    log = str(tmp_path / "run.jsonl")
    command = [mpiexec(), "-n", "2", sys.executable, "-m", "minipar", "train", *TINY, "--steps", "100000", "--json",
               "--eval-interval", "0", "--dp", "2", "--comm-timeout", "2", "--log-file", log]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, **RANK_ENV})
    try:
        assert _strict_json(proc.stdout.readline())["step"] == 1
        stopped = _rank_pids(log)[-1]
        os.kill(stopped, signal.SIGSTOP)
        start = time.monotonic()
        _, err = proc.communicate(timeout=30)
        waited = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0 and 2 <= waited < 20, (proc.returncode, waited, err)
    lines = [line for line in err.splitlines() if "did not answer" in line]
    assert lines, err
    line = lines[0]
    waiter, silent = int(line.split("rank ")[1].split()[0]), int(line.split("for rank ")[1].split(",")[0])
    assert {waiter, silent} == {0, 1} and " in all_reduce" in line and "(--comm-timeout 2)" in line, line


@pytest.mark.parametrize("case", ["flags", "data"])
def test_ranks_started_differently_are_refused(tmp_path, case):
    """Ranks launched with different flags (MPMD) or reading different data under the same path (their own
    working directories) refuse to start, in one line naming what differs on which rank — not a hang."""
    for rank in (0, 1):
        (tmp_path / str(rank)).mkdir()
        (tmp_path / str(rank) / "corpus.txt").write_text(f"the corpus of rank {rank} " * 200)
    run = [sys.executable, "-m", "minipar", "train", *TINY, "--eval-interval", "0", "--data", "corpus.txt", "--dp", "2"]
    steps = ("3", "5") if case == "flags" else ("3", "3")
    command = [*run, "--steps", steps[0], ":", "-n", "1", "-wdir", str(tmp_path / "1"), *run, "--steps", steps[1]]
    if case == "data":
        (tmp_path / "1" / "corpus.txt").write_text("another text entirely " * 200)
    with pytest.raises(AssertionError) as failure:
        run_command(1, command, timeout=60, launcher=["-wdir", str(tmp_path / "0")])
    report = str(failure.value)
    expected = ("ranks' arguments differ: --steps 3 on rank 0, 5 on rank 1" if case == "flags" else
                "ranks' data differ: corpus.txt (sha256 ")
    assert report.count(expected) == 1 and "exit 2" in report, report


def test_errors_every_rank_shares_are_printed_once():
    with pytest.raises(AssertionError) as failure:
        _train(2, ["--tp", "3"])
    report = str(failure.value)
    assert report.count("minipar train: error:") == 1 and "world size 2 is not divisible by tp·pp·cp = 3·1·1" in report
    assert "error on rank" not in report and "exit 2" in report
