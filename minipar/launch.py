"""``python -m minipar launch -n N [--hosts h1,h2 --ppn P] [--max-restarts R] [--min-ranks M] -- train ...``

A supervisor above ``mpiexec``, as torchrun's elastic agent is above its workers. It starts the job; when the job
fails by a fault — a rank killed or crashed, a stopped rank ended by the others' ``--comm-timeout``, a host's ranks
gone — it restarts ``train`` from the newest complete checkpoint (of ``--save`` and ``--local-save``, whichever is
newer), up to R times. A host that fails twice in a row is dropped when ``--min-ranks`` allows it: the job goes on
with the ranks that remain. A job that fails by an error train reports itself (bad input, a diverged loss, a full
disk: exit code 2) is not restarted — it would fail again.

Exactness. Step s trains on batch s of a fixed order (``Batches``), from the state the checkpoint of step s holds
bit for bit (parameters, AdamW moments and step, the loss scale, the router biases, each rank's own state), so a
restart in the same layout repeats the lost steps exactly: the run ends bit-identical to one never interrupted.
Shrinking keeps the global batch and its order: dp → dp' ranks each take dp/dp' times the rows, as dp/dp' times as
many microbatches of the same size; every microbatch's loss is weighted by its share of the global batch's tokens, so
the gradient is the same sum over the same rows, added in another order — equal to float64 rounding (rtol 1e-9).

Events are single lines on stderr (``launch: ...``); the job's own output passes through unchanged.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

LAUNCH_DIR_ENV = "MINIPAR_LAUNCH_DIR"  # set by the launcher: each rank writes its pid there (announce_rank)
FAILED_BY_ERROR = 2  # train's exit code for an error it reported (minipar/__main__.py): restarting would repeat it
WATCHDOG_ABORT = 3  # the exit code of a rank whose --comm-timeout ran out (comm/communicator.py)
HOST_STRIKES = 2  # consecutive faults on one host before it is dropped


def announce_rank(rank: int) -> None:
    """Under the launcher, record this rank's pid so that a death mpiexec reports by pid can be named by rank."""
    folder = os.environ.get(LAUNCH_DIR_ENV)
    if folder:
        with open(os.path.join(folder, f"rank{rank}.pid"), "w", encoding="utf-8") as f:
            f.write(str(os.getpid()))


@dataclasses.dataclass
class Shape:
    """The ranks a job runs on and the two flags a shrink changes."""
    hosts: list[str]  # [] : mpiexec's default (this machine)
    ranks: int
    dp: int
    microbatches: int

    def host_of(self, rank: int, ppn: int) -> str | None:
        """mpiexec -ppn P fills the hosts in order: ranks 0..P-1 on the first, and so on (None: no --hosts)."""
        return self.hosts[rank // ppn] if self.hosts else None


@dataclasses.dataclass
class Attempt:
    """What one run of mpiexec showed: the steps it logged (with when), how it ended, and who ended it."""
    started: float
    resumed_step: int
    step_times: dict[int, float] = dataclasses.field(default_factory=dict)
    dead_pid: int | None = None
    dead_host: str | None = None
    exit_code: int | None = None  # the failing rank's, as mpiexec reports it
    stalled_rank: int | None = None  # the rank another one waited for past --comm-timeout
    error: str = ""  # the last error line the job printed
    returncode: int = 0
    ended: float = 0.0

    STEP_TEXT = re.compile(r"^step\s+(\d+)/\d+ \|")
    DEAD = re.compile(r"PID (\d+) RUNNING AT (\S+)")
    EXIT = re.compile(r"EXIT CODE: (\d+)")
    STALL = re.compile(r"rank \d+ waited .* for rank (\d+), which did not answer")

    def read(self, line: str) -> None:
        """Take note of one line of the job's output: a step's progress (text or --json), mpiexec's report of the
        first rank that ended badly (its pid, host and exit code), the watchdog naming a rank that stopped
        answering, an error line."""
        text = line.strip().lstrip("= ").rstrip()
        step = self.STEP_TEXT.match(text)
        if step:
            self.step_times[int(step.group(1))] = time.monotonic()
        elif text.startswith('{"step"'):
            try:
                record = json.loads(text)
            except json.JSONDecodeError:
                record = {}
            if "loss" in record:
                self.step_times[int(record["step"])] = time.monotonic()
        dead, exit_code, stall = (pattern.search(text) for pattern in (self.DEAD, self.EXIT, self.STALL))
        if dead and self.dead_pid is None:
            self.dead_pid, self.dead_host = int(dead.group(1)), dead.group(2)
        if exit_code and self.exit_code is None:
            self.exit_code = int(exit_code.group(1))
        if stall and self.stalled_rank is None:
            self.stalled_rank = int(stall.group(1))
        if text.startswith("minipar") and "error" in text:
            self.error = text

    @property
    def last_step(self) -> int:
        return max(self.step_times, default=self.resumed_step)


class Launcher:
    """Runs the job until it finishes, restarting it after faults (module docstring)."""

    def __init__(self, args: argparse.Namespace, train_flags: list[str],
                 parse_train: Callable[[list[str]], argparse.Namespace]):
        self.args, self.flags, self.parse_train = args, train_flags, parse_train
        self.train = parse_train(train_flags)
        self.interrupted = 0
        self.process: subprocess.Popen | None = None
        self.lock = threading.Lock()
        hosts = args.hosts.split(",") if args.hosts else []
        tp_pp_cp = self.train.tp * self.train.pp * self.train.cp
        self.shape = Shape(hosts, args.n, self.train.dp or args.n // max(1, tp_pp_cp), self.train.microbatches)
        self.launch_dir = os.path.join(self.train.save or "", ".launch")  # where the ranks write their pids

    # ------------------------------------------------------------------ checks before anything starts

    def check(self) -> None:
        """Bad input, refused in one line before any rank starts."""
        a, t = self.args, self.train
        if a.n < 1:
            raise ValueError(f"-n must be at least 1, got {a.n}")
        if a.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {a.max_restarts}")
        if a.min_ranks is not None and not 1 <= a.min_ranks <= a.n:
            raise ValueError(f"--min-ranks {a.min_ranks} must be between 1 and -n {a.n}")
        if bool(a.hosts) != bool(a.ppn):
            raise ValueError("--hosts and --ppn go together: the launcher places ranks host by host to know which "
                             "host a dead rank ran on")
        if a.hosts and len(self.shape.hosts) * a.ppn != a.n:
            raise ValueError(f"--hosts {a.hosts} --ppn {a.ppn} make {len(self.shape.hosts) * a.ppn} ranks, not -n {a.n}")
        if not t.save:
            raise ValueError("launch restarts from checkpoints: pass --save DIR to train (and --save-interval)")
        if t.auto:
            raise ValueError("launch needs a fixed layout to repeat on a restart: drop --auto (python -m minipar plan "
                             "prints the layout it would choose)")
        self.validate(self.shape)

    def validate(self, shape: Shape) -> None:
        """The layout ``shape`` gives, checked by train's own rules (Layout.validate) for shape.ranks ranks."""
        from minipar.cli import validate

        validate(self.parse_train(self.train_flags(shape, None)), shape.ranks, None)

    def train_flags(self, shape: Shape, resume: str | None) -> list[str]:
        """The user's train flags, with --resume, and --dp/--microbatches when the job shrank."""
        flags = strip_flags(self.flags, ("--resume",) if resume else ())
        if shape.ranks != self.args.n:
            flags = strip_flags(flags, ("--dp", "--microbatches")) + ["--dp", str(shape.dp), "--microbatches",
                                                                       str(shape.microbatches)]
        return flags + (["--resume", resume] if resume else [])

    def shrink(self, host: str) -> Shape:
        """The shape without ``host``: dp shrinks, the microbatches grow by as much (the global batch is kept)."""
        hosts = [h for h in self.shape.hosts if h != host]
        ranks = len(hosts) * self.args.ppn
        fixed = self.shape.ranks // self.shape.dp  # tp·pp·cp ranks per replica stay as they are
        if ranks % fixed or self.shape.dp * self.shape.microbatches % (ranks // fixed or 1) or ranks < fixed:
            raise ValueError(f"dropping host {host} leaves {ranks} ranks: no layout keeps the global batch "
                             f"(tp·pp·cp = {fixed}, dp {self.shape.dp} × microbatches {self.shape.microbatches})")
        dp = ranks // fixed
        shape = Shape(hosts, ranks, dp, self.shape.dp * self.shape.microbatches // dp)
        self.validate(shape)
        return shape

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        from minipar.checkpoint import newest_checkpoint

        restarts, redone, lost = 0, 0, 0.0
        resume = self.train.resume
        previous_failure_end: float | None = None
        strikes: tuple[str | None, int] = (None, 0)
        said: set[str] = set()
        os.makedirs(self.launch_dir, exist_ok=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.on_signal)
        found, notes = newest_checkpoint(self.train.save, self.train.local_save)  # verified: every file's sha256
        while True:
            for note in notes:
                if note not in said:  # a damaged checkpoint stays damaged: said once
                    say(note)
                    said.add(note)
            if found is not None:
                resume = found.path
            resumed_step = found.step if found else 0
            if resumed_step >= self.train.steps:
                say(f"{found.path} is at step {resumed_step} = --steps: nothing left to train")
                return 0
            attempt = self.start(resume, resumed_step)
            if previous_failure_end is not None and attempt.step_times:
                lost += min(attempt.step_times.values()) - previous_failure_end
            if attempt.returncode == 0:
                shutil.rmtree(self.launch_dir, ignore_errors=True)
                say(f"finished step {self.train.steps}: {restarts} restart{'s' * (restarts != 1)}, {redone} "
                    f"step{'s' * (redone != 1)} redone, {lost:.1f} s lost")
                return 0
            if self.interrupted:
                say(f"stopped on request (Ctrl-C) at step {attempt.last_step}: not restarting")
                return 128 + self.interrupted
            if attempt.exit_code == FAILED_BY_ERROR or (attempt.exit_code is None and
                                                        attempt.returncode == FAILED_BY_ERROR):
                say(f"the job stopped with an error, not a fault: not restarting ({attempt.error or 'see above'})")
                return FAILED_BY_ERROR
            who, host, how = self.culprit(attempt)
            found, notes = newest_checkpoint(self.train.save, self.train.local_save)  # what the restart takes
            kept = found.step if found else 0
            at = max(attempt.last_step, kept) + 1  # the step it was in (at least: --log-interval may hide some)
            redone += max(0, attempt.last_step - kept)
            lost += attempt.ended - attempt.step_times.get(kept, attempt.started)
            previous_failure_end = attempt.ended
            if restarts == self.args.max_restarts:
                say(f"{who} {how} at step {at}; --max-restarts {self.args.max_restarts} used up: giving up"
                    + (f" (last error: {attempt.error})" if attempt.error else ""))
                return attempt.returncode or 1
            restarts += 1
            strikes = (host, strikes[1] + 1 if strikes[0] == host else 1)
            change = ""
            if host and strikes[1] >= HOST_STRIKES and len(self.shape.hosts) > 1 and \
                    (len(self.shape.hosts) - 1) * self.args.ppn >= (self.args.min_ranks or self.args.n):
                shape = self.shrink(host)
                change = (f", without host {host} (failed {strikes[1]} times in a row): dp {self.shape.dp} → {shape.dp},"
                          f" microbatches {self.shape.microbatches} → {shape.microbatches}")
                self.shape, strikes = shape, (None, 0)
            say(f"{who} {how} at step {at}: restarting from step {kept} on "
                f"{self.shape.ranks} ranks{change} (restart {restarts} of {self.args.max_restarts})")

    def culprit(self, attempt: Attempt) -> tuple[str, str | None, str]:
        """Who ended the attempt ("rank 3 (host h2)"), its host, and how — as mpiexec and the watchdog report it."""
        pids = {}
        for name in os.listdir(self.launch_dir):
            if name.startswith("rank") and name.endswith(".pid"):
                with open(os.path.join(self.launch_dir, name), encoding="utf-8") as f:
                    text = f.read().strip()
                if text.isdigit():
                    pids[int(text)] = int(name[4:-4])
        rank = attempt.stalled_rank if attempt.stalled_rank is not None else pids.get(attempt.dead_pid)
        host = self.shape.host_of(rank, self.args.ppn) if rank is not None else \
            (attempt.dead_host if self.shape.hosts else None)
        if attempt.stalled_rank is not None:
            how = "stopped answering (--comm-timeout)"
        elif attempt.exit_code in {s.value for s in signal.Signals} - {FAILED_BY_ERROR, WATCHDOG_ABORT}:
            how = f"was killed ({signal.Signals(attempt.exit_code).name})"  # mpiexec reports a signal by its number
        else:
            how = f"ended the job (exit code {attempt.exit_code if attempt.exit_code is not None else attempt.returncode})"
        who = (f"rank {rank}" if rank is not None else f"a rank (pid {attempt.dead_pid})") + \
            (f" (host {host})" if host else "")
        return who, host, how

    def start(self, resume: str | None, resumed_step: int) -> Attempt:
        """Run mpiexec once, passing its output through; the attempt's record."""
        from minipar.testing import mpiexec

        for name in os.listdir(self.launch_dir):
            os.remove(os.path.join(self.launch_dir, name))
        placement = ["-hosts", ",".join(self.shape.hosts), "-ppn", str(self.args.ppn)] if self.shape.hosts else []
        bootstrap = ["-launcher", self.args.bootstrap] if self.args.bootstrap else []
        command = [mpiexec(), "-n", str(self.shape.ranks), *placement, *bootstrap, sys.executable, "-m", "minipar",
                   "train", *self.train_flags(self.shape, resume)]
        attempt = Attempt(time.monotonic(), resumed_step)
        with self.lock:
            if self.interrupted:
                attempt.returncode = 128 + self.interrupted
                return attempt
            self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                            bufsize=1, start_new_session=True,
                                            env={**os.environ, LAUNCH_DIR_ENV: self.launch_dir})
        readers = [threading.Thread(target=self.pass_through, args=(stream, out, attempt), daemon=True)
                   for stream, out in ((self.process.stdout, sys.stdout), (self.process.stderr, sys.stderr))]
        for reader in readers:
            reader.start()
        attempt.returncode = self.process.wait()
        for reader in readers:
            reader.join()
        attempt.ended = time.monotonic()
        return attempt

    def pass_through(self, stream: Any, out: Any, attempt: Attempt) -> None:
        for line in stream:
            out.write(line)
            out.flush()
            with self.lock:
                attempt.read(line)

    def on_signal(self, signum: int, frame: Any) -> None:
        """The first Ctrl-C (or SIGTERM) is passed to the job — its ranks finish the step, checkpoint and stop — and
        ends the launcher once the job has; a second one kills the job at once."""
        with self.lock:
            process, first = self.process, not self.interrupted
            self.interrupted = self.interrupted or signum
        if process is None or process.poll() is not None:
            return
        if first:
            say(f"{signal.Signals(signum).name}: stopping the job at the end of its step (again to kill it now)")
            process.send_signal(signal.SIGINT)
        else:
            os.killpg(process.pid, signal.SIGKILL)


def strip_flags(flags: list[str], names: tuple[str, ...]) -> list[str]:
    """``flags`` without the options ``names`` (``--x V`` or ``--x=V``)."""
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in names:
            skip = True
        elif not flag.split("=", 1)[0] in names:
            out.append(flag)
    return out


def say(line: str) -> None:
    print(f"launch: {line}", file=sys.stderr, flush=True)


def launch(args: argparse.Namespace, parse_train: Callable[[list[str]], argparse.Namespace]) -> int:
    """``python -m minipar launch``: check, then supervise; ``parse_train`` reads train's flags as train does."""
    command = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
    if command[:1] != ["train"]:
        raise ValueError(f"launch supervises training: the command after -- must be train ..., got "
                         f"{' '.join(command[:1]) or 'nothing'}")
    launcher = Launcher(args, command[1:], parse_train)
    launcher.check()
    return launcher.run()
