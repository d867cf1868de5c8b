"""python -m minipar launch: a run whose ranks are killed, stopped, or whose host is lost ends where an uninterrupted
run ends — bit for bit in the same layout, to float64 rounding when it shrank — and the faults that must not be
retried (a full disk, restarts used up, Ctrl-C) stop it in one line. Kill times are drawn from a seed; every run is
under a deadline and killed with its process group when the test ends."""
import os
import re
import resource
import socket
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from minipar.__main__ import main
from minipar.checkpoint import load_checkpoint, newest_complete
from minipar.testing import RANK_ENV, mpiexec

MODEL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "8",
         "--eval-interval", "0", "--lr", "3e-3", "--warmup", "2", "--dtype", "float64", "--steps", "40"]
SAME_LAYOUT = ["--zero", "1"]  # dp 2 on 2 ranks, Adam's moments sharded
DEADLINE = 150.0


class Launched:
    """``python -m minipar launch ...`` in the background: its output as it comes, its ranks' pids, kills."""

    def __init__(self, args, save, env=None):
        self.save, self.lines, self.done = save, [], threading.Condition()
        self.proc = subprocess.Popen([sys.executable, "-m", "minipar", "launch", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                     env={**os.environ, **RANK_ENV, **(env or {})})
        self.deadline = time.monotonic() + DEADLINE
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            with self.done:
                self.lines.append(line.rstrip("\n"))
                self.done.notify_all()
        with self.done:
            self.lines.append(None)  # end of output
            self.done.notify_all()

    def output(self):
        return "\n".join(line for line in self.lines if line is not None)

    def wait_for(self, predicate, what):
        """The first line from now on that ``predicate`` accepts."""
        with self.done:
            seen = len(self.lines)
            while True:
                for line in self.lines[seen:]:
                    if line is None:
                        raise AssertionError(f"the launcher ended before {what}:\n{self.output()}")
                    if predicate(line):
                        return line
                seen = len(self.lines)
                if not self.done.wait(timeout=max(0.0, self.deadline - time.monotonic())):
                    raise AssertionError(f"timed out waiting for {what}:\n{self.output()}")

    def reach(self, step):
        """Wait until the job has logged step ``step`` or later."""
        self.wait_for(lambda line: (m := re.match(r"step\s+(\d+)/", line)) and int(m.group(1)) >= step, f"step {step}")

    def pid(self, rank, not_=None):
        """Rank ``rank``'s pid in the current attempt (``not_``: a pid of an earlier attempt, to wait past)."""
        path = os.path.join(self.save, ".launch", f"rank{rank}.pid")
        while time.monotonic() < self.deadline:
            try:
                with open(path) as f:
                    text = f.read().strip()
                if text.isdigit() and int(text) != not_:
                    return int(text)
            except FileNotFoundError:
                pass
            time.sleep(0.01)
        raise AssertionError(f"rank {rank} never started:\n{self.output()}")

    def kill(self, rank, sig=signal.SIGKILL):
        pid = self.pid(rank)
        os.kill(pid, sig)
        return pid

    def finish(self):
        try:
            rc = self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"the launcher did not finish in {DEADLINE:.0f} s:\n{self.output()}")
        with self.done:
            self.done.wait_for(lambda: self.lines and self.lines[-1] is None, timeout=10)
        return rc, self.output()

    def close(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def launched():
    runs = []

    def start(args, save, env=None):
        runs.append(Launched(args, save, env))
        return runs[-1]

    yield start
    for run in runs:
        run.close()


def final_params(save):
    return load_checkpoint(save).params


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run in the same layout (2 ranks, ZeRO-1), straight under mpiexec."""
    save = str(tmp_path_factory.mktemp("reference") / "c")
    subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "minipar", "train", *MODEL, *SAME_LAYOUT,
                    "--save", save], check=True, capture_output=True, timeout=DEADLINE, env={**os.environ, **RANK_ENV})
    return final_params(save)


def freeze(run):
    """SIGSTOP every rank of the job (a write in flight stays unfinished: no manifest, not a candidate)."""
    pids = [run.pid(rank) for rank in range(2)]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    time.sleep(0.3)
    return pids


def assert_bit_identical(params, expected):
    assert params.keys() == expected.keys()
    for name, value in expected.items():
        assert np.array_equal(params[name], value), f"{name} differs from the uninterrupted run"


# ---------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("launcher,train,message", [
    (["-n", "2", "--min-ranks", "3"], ["--save", "SAVE"], "--min-ranks 3 must be between 1 and -n 2"),
    (["-n", "2", "--max-restarts", "-1"], ["--save", "SAVE"], "--max-restarts must be >= 0"),
    (["-n", "4", "--hosts", "a,b", "--ppn", "3"], ["--save", "SAVE"], "--hosts a,b --ppn 3 make 6 ranks, not -n 4"),
    (["-n", "4", "--hosts", "a,b"], ["--save", "SAVE"], "--hosts and --ppn go together"),
    (["-n", "2"], [], "pass --save DIR to train"),
    (["-n", "2"], ["--save", "SAVE", "--auto"], "drop --auto"),
    (["-n", "3"], ["--save", "SAVE", "--tp", "2"], "world size 3"),
    (["-n", "2"], None, "the command after -- must be train ..., got generate"),
])
def test_bad_input_is_refused_in_one_line(launcher, train, message, capsys, tmp_path):
    save = str(tmp_path / "c")
    command = ["generate"] if train is None else ["train", "--steps", "4", *[save if f == "SAVE" else f for f in train]]
    assert main(["launch", *launcher, "--", *command]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("minipar launch: error: ") and "\n" not in err and message in err, err
    assert not os.path.exists(save), "nothing may start before the input is checked"


# ---------------------------------------------------------------------------------- exactness


@pytest.mark.slow  # ~10 s: four starts of a 2-rank job
def test_three_kills_end_bit_identical(launched, reference, tmp_path):
    """kill -9 of a random rank at random steps, three times — the second while the job is restarting."""
    rng = np.random.default_rng(51)
    save = str(tmp_path / "c")
    run = launched(["-n", "2", "--", "train", *MODEL, *SAME_LAYOUT, "--save", save, "--save-interval", "2"], save)
    steps = sorted(int(k) for k in rng.choice(np.arange(4, 30), size=2, replace=False))
    run.reach(steps[0])
    before = run.pid(0)
    run.kill(int(rng.integers(2)))
    run.wait_for(lambda line: "restarting from step" in line, "the first restart")
    os.kill(run.pid(int(rng.integers(2)), not_=before), signal.SIGKILL)  # before the restarted job's first step
    run.wait_for(lambda line: "restarting from step" in line, "the second restart")
    run.reach(steps[1])
    run.kill(int(rng.integers(2)))
    rc, out = run.finish()
    assert rc == 0, out
    assert "launch: finished step 40: 3 restarts" in out
    assert len(re.findall(r"was killed \(SIGKILL\) at step \d+: restarting from step \d+ on 2 ranks", out)) == 3, out
    assert_bit_identical(final_params(save), reference)


@pytest.mark.slow  # ~12 s: four starts, writes slowed to 0.1 s a file
def test_kill_during_a_write_and_the_local_tier(launched, reference, tmp_path):
    """A fast tier every 2 steps beside the durable one every 6: a kill during a (slowed) write restarts from the
    newest complete checkpoint — the local one — never from the half-written step; with the local tier gone (lost
    with its host) the launcher falls back to the durable checkpoint and says so."""
    save, local = str(tmp_path / "c"), str(tmp_path / "shm")
    run = launched(["-n", "2", "--", "train", *MODEL, *SAME_LAYOUT, "--save", save, "--save-interval", "6",
                    "--local-save", local, "--local-save-interval", "2"], save,
                   env={"MINIPAR_CHECKPOINT_WRITE_DELAY": "0.1"})
    run.reach(9)
    run.kill(1)
    in_flight = [int(d[5:]) for root in (save, local) for d in os.listdir(root) if d.startswith("step_")
                 and not os.path.exists(os.path.join(root, d, "manifest.json"))]
    newest = max(newest_complete(root)[0].step for root in (save, local))
    line = run.wait_for(lambda line: "restarting from step" in line, "the restart")
    assert in_flight and max(in_flight) > newest and f"restarting from step {newest} " in line, (in_flight, line)
    while (near := newest_complete(local)[0]) is None or near.step <= newest_complete(save)[0].step:
        time.sleep(0.01)  # until the local tier is ahead of the durable one
    pids = freeze(run)
    near = newest_complete(local)[0]
    os.kill(pids[0], signal.SIGKILL)
    line = run.wait_for(lambda line: "restarting from step" in line, "the restart from the local tier")
    assert f"restarting from step {near.step} " in line, (near, line)
    run.reach(near.step + 3)
    before = run.pid(1)
    shutil.rmtree(local)  # the host's memory is gone with it
    os.kill(before, signal.SIGKILL)
    note = run.wait_for(lambda line: "no complete local checkpoint" in line, "the fallback")
    assert f"falling back to the durable {save}/step_" in note
    rc, out = run.finish()
    assert rc == 0, out
    assert_bit_identical(final_params(save), reference)


@pytest.mark.slow  # ~12 s: a 2 s --comm-timeout, three starts
def test_a_stopped_rank_and_a_damaged_checkpoint(launched, reference, tmp_path):
    """SIGSTOP of a rank: the others' --comm-timeout ends the job, the launcher names the stopped rank and restarts.
    Then the newest checkpoint is damaged (one byte of a shard flipped) as the job dies: it is skipped, said once,
    and the one before it used."""
    save = str(tmp_path / "c")
    run = launched(["-n", "2", "--", "train", *MODEL, *SAME_LAYOUT, "--save", save, "--save-interval", "2",
                    "--comm-timeout", "2"], save)
    run.reach(7)
    run.kill(1, signal.SIGSTOP)
    line = run.wait_for(lambda line: "restarting from step" in line, "the restart after the stall")
    assert "rank 1 stopped answering (--comm-timeout)" in line, line
    run.reach(15)
    pids = freeze(run)  # its newest checkpoint stays the newest while it is damaged
    damaged, _ = newest_complete(save)
    with open(os.path.join(damaged.path, "pp0-tp0.safetensors"), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    os.kill(pids[0], signal.SIGKILL)
    line = run.wait_for(lambda line: "restarting from step" in line, "the restart after the damage")
    assert int(re.search(r"restarting from step (\d+)", line).group(1)) < damaged.step
    rc, out = run.finish()
    assert rc == 0, out
    assert out.count(f"skipped damaged checkpoint {damaged.path} ") == 1, out
    assert_bit_identical(final_params(save), reference)


@pytest.mark.slow  # ~12 s each: the ranks on their "hosts", then fewer
@pytest.mark.parametrize("hosts,ppn,microbatches,after", [
    (["localhost", "127.0.0.1"], 2, 1, "dp 4 → 2, microbatches 1 → 2"),
    (["localhost", "127.0.0.1", socket.gethostname()], 1, 2, "dp 3 → 2, microbatches 2 → 3"),  # an odd degree
])
def test_a_host_that_keeps_failing_is_dropped(launched, tmp_path, hosts, ppn, microbatches, after):
    """Ranks on two or three hosts (hydra's fork launcher: every name is this machine); a rank on the last host dies
    twice in a row: the launcher goes on without that host — dp shrinks, the microbatches grow by as much (4 → 2
    with 1 → 2; 3 → 2 with 2 → 3, 12 rows either way) — and ends where the uninterrupted run on every host ends,
    to float64 rounding (the same rows, summed in another order)."""
    save, whole = str(tmp_path / "c"), str(tmp_path / "whole")
    n, last = len(hosts) * ppn, hosts[-1]
    batch = ["--batch-size", "12", "--microbatches", str(microbatches)]
    env = {**os.environ, **RANK_ENV, "HOME": str(tmp_path)}
    subprocess.run([mpiexec(), "-n", str(n), sys.executable, "-m", "minipar", "train", *MODEL, *batch, "--save", whole],
                   check=True, capture_output=True, timeout=DEADLINE, env=env)
    rng = np.random.default_rng(4)
    run = launched(["-n", str(n), "--hosts", ",".join(hosts), "--ppn", str(ppn), "--bootstrap", "fork", "--min-ranks",
                    "2", "--", "train", *MODEL, *batch, "--save", save, "--save-interval", "2"], save,
                   env={"HOME": str(tmp_path)})
    on_last = range(n - ppn, n)
    run.reach(int(rng.integers(3, 12)))
    before = run.kill(int(rng.choice(on_last)))
    first = run.wait_for(lambda line: "restarting from step" in line, "the first restart")
    assert f"(host {last})" in first and f"on {n} ranks (restart 1" in first, first
    run.reach(int(rng.integers(14, 20)))
    os.kill(run.pid(int(rng.choice(on_last)), not_=before), signal.SIGKILL)
    second = run.wait_for(lambda line: "restarting from step" in line, "the second restart")
    assert f"on {n - ppn} ranks, without host {last} (failed 2 times in a row): {after}" in second, second
    rc, out = run.finish()
    assert rc == 0, out
    assert f"dp2·tp1·pp1 zero0 m{after[-1]}" in out
    params, expected = final_params(save), final_params(whole)
    for name, value in expected.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-9, atol=1e-12, err_msg=name)


@pytest.mark.slow  # ~6 s
def test_a_full_disk_stops_the_launcher(launched, tmp_path):
    """The ranks' file-size limit drops below a shard's size mid-run (a full disk, simulated once MPI has made its
    shared-memory files): one line names the file, the checkpoints before it are kept, and the launcher stops
    instead of restarting into the same wall."""
    save = str(tmp_path / "c")
    run = launched(["-n", "2", "--", "train", *MODEL, "--save", save, "--save-interval", "2"], save)
    run.reach(3)
    run.wait_for(lambda line: line.startswith("checkpoint "), "a checkpoint")
    while newest_complete(save)[0] is None:
        time.sleep(0.01)
    for rank in range(2):  # above every small file of a save (tokenizer ≤ 2.7 kB, manifest 1.9 kB), below a shard's
        resource.prlimit(run.pid(rank), resource.RLIMIT_FSIZE, (8192, 8192))  # 260 kB: the shard is what fails
    rc, out = run.finish()
    assert rc == 2, out
    assert re.search(r"checkpoint: cannot write \S+/step_\d+/pp0-tp0.safetensors \(File too large\); the "
                     r"checkpoints written before it are kept", out), out
    assert "launch: the job stopped with an error, not a fault: not restarting" in out and "restarting from" not in out
    kept, skipped = newest_complete(save)
    assert kept is not None and kept.step >= 2


@pytest.mark.slow  # ~6 s
def test_restarts_used_up_and_ctrl_c(launched, tmp_path):
    """--max-restarts 1 and two kills: the launcher gives up with the last failure, exit non-zero. Ctrl-C: the job
    checkpoints at its step's end and stops with the launcher — once, no restart."""
    save = str(tmp_path / "c")
    run = launched(["-n", "2", "--max-restarts", "1", "--", "train", *MODEL, "--save", save, "--save-interval", "2"],
                   save)
    run.reach(3)
    before = run.kill(1)
    run.wait_for(lambda line: "restarting from step" in line, "the restart")
    os.kill(run.pid(1, not_=before), signal.SIGKILL)
    rc, out = run.finish()
    assert rc != 0 and "--max-restarts 1 used up: giving up" in out, out
    save = str(tmp_path / "d")
    run = launched(["-n", "2", "--", "train", *MODEL, "--save", save], save)
    run.reach(5)
    run.proc.send_signal(signal.SIGINT)
    rc, out = run.finish()
    assert rc == 130, out
    stopped = re.search(r"interrupted at step (\d+) \(SIGINT\)", out)
    assert stopped and "launch: stopped on request (Ctrl-C)" in out and "restarting from" not in out, out
    assert newest_complete(save)[0].step == int(stopped.group(1))
