"""Test helpers: finite-difference gradient checks and the multi-rank test harness.

``run_ranks(n, fn, *args)`` runs ``fn(*args)`` on n MPI ranks by spawning the mpich wheel's
``mpiexec -n n`` under a hard timeout. A rank whose ``fn`` raises prints its traceback and calls
``MPI_Abort``, which makes mpiexec kill every rank at once: one failing rank fails the test in
seconds. A rank that hangs is killed with its whole process group when the timeout expires. Either
way the test gets an ``AssertionError`` carrying every rank's output.

    def _ranks_agree():                  # module-level, in the test file
        comm = MPI.COMM_WORLD
        assert comm.allreduce(1) == comm.size

    def test_agree():
        run_ranks(4, _ranks_agree)

Deep dive, with measurements: docs/testing.md.
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

import numpy as np

from minipar.autograd import Tensor

# ------------------------------------------------------------------------------------- gradcheck


def gradcheck(fn: Callable[..., Tensor], *inputs: np.ndarray, eps: float = 1e-6, rtol: float = 1e-5,
              atol: float = 1e-7, seed: int = 0) -> None:
    """Compare autograd's gradient of ``fn`` with central differences, in float64.

    The output is reduced to a scalar with fixed random weights, L = Σ fn(x) ⊙ R, so every output
    element's gradient is checked at once; then ∂L/∂xᵢ ≈ (L(x + ε eᵢ) − L(x − ε eᵢ)) / 2ε for each
    element i of each input. Raises AssertionError naming the first input and element that differ.
    """
    inputs = [np.array(x, dtype=np.float64) for x in inputs]
    weights = np.random.default_rng(seed).standard_normal(np.shape(fn(*[Tensor(x) for x in inputs]).data))

    def scalar(arrays: list[np.ndarray]) -> float:
        return float((fn(*[Tensor(a) for a in arrays]).data * weights).sum())

    tensors = [Tensor(x.copy(), requires_grad=True) for x in inputs]
    (fn(*tensors) * Tensor(weights)).sum().backward()
    for k, (x, t) in enumerate(zip(inputs, tensors)):
        analytic = np.zeros_like(x) if t.grad is None else np.asarray(t.grad)
        numeric = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            old = x[i]
            x[i] = old + eps
            plus = scalar(inputs)
            x[i] = old - eps
            minus = scalar(inputs)
            x[i] = old
            numeric[i] = (plus - minus) / (2 * eps)
        bad = ~np.isclose(analytic, numeric, rtol=rtol, atol=atol)
        if bad.any():
            i = tuple(int(j) for j in np.argwhere(bad)[0])
            raise AssertionError(f"input {k} element {i}: autograd {analytic[i]!r} vs finite differences {numeric[i]!r} "
                                 f"({int(bad.sum())} of {bad.size} elements differ)")


# ---------------------------------------------------------------------------------- rank harness


def mpiexec() -> str:
    """The mpiexec next to this Python (the mpich wheel's), else the first on PATH."""
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = local if os.path.exists(local) else shutil.which("mpiexec")
    if not found:
        raise RuntimeError("mpiexec not found: pip install mpich (minipar's MPI runtime)")
    return found


RANK_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def rank_environment(one_thread: bool = True) -> dict[str, str]:
    """The ranks' environment: this one with :data:`RANK_ENV` (one BLAS thread per rank: tests run side by side), or
    (``one_thread=False``) without any BLAS thread setting — as a user's ``mpiexec`` runs them, each rank taking its
    share of the cores (backend.share_cores)."""
    if one_thread:
        return {**os.environ, **RANK_ENV}
    return {**{k: v for k, v in os.environ.items() if k not in RANK_ENV}, "PYTHONUNBUFFERED": "1"}


def run_command(n: int, command: list[str], timeout: float = 60.0, env: dict[str, str] | None = None,
                launcher: list[str] | None = None, one_thread: bool = True) -> str:
    """Run ``mpiexec [launcher...] -n n command...``; return its output, or raise AssertionError on failure or
    timeout. ``launcher``: extra mpiexec options, e.g. ``["-hosts", "a,b", "-ppn", "2"]``; ``one_thread``: see
    :func:`rank_environment`."""
    full_env = {**rank_environment(one_thread), **(env or {})}
    proc = subprocess.Popen([mpiexec(), *(launcher or []), "-n", str(n), *command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=full_env, start_new_session=True, text=True)
    start = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # mpiexec, its proxies and every rank share this session
        out, _ = proc.communicate()
        raise AssertionError(f"{n} ranks timed out after {timeout:.0f} s (killed); output:\n{_tail(out)}") from None
    if proc.returncode != 0:
        raise AssertionError(f"{n} ranks failed (exit {proc.returncode}) after {time.monotonic() - start:.1f} s; "
                             f"output:\n{_tail(out)}")
    return out


def run_ranks(n: int, fn: Callable[..., Any], *args: Any, timeout: float = 60.0, env: dict[str, str] | None = None,
              launcher: list[str] | None = None) -> str:
    """Run the module-level function ``fn(*args)`` (JSON-able args) on ``n`` ranks; see the module docstring."""
    path = inspect.getsourcefile(fn)
    command = [sys.executable, "-m", "minipar.testing", path, fn.__name__, json.dumps(args)]
    return run_command(n, command, timeout=timeout, env=env, launcher=launcher)


def train_cli(args: list[str], ranks: int = 1, out: str | None = None, timeout: float = 300.0,
              one_thread: bool = True) -> tuple[list, dict | None]:
    """Run ``python -m minipar train *args`` (which should include --json) on ``ranks`` ranks — plain
    python for one — and return its JSON records and, when ``out`` is given (passed as --out), the
    parameters it saved. ``one_thread``: see :func:`rank_environment`."""
    command = [sys.executable, "-m", "minipar", "train", *args, *(["--out", out] if out else [])]
    if ranks == 1:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=rank_environment(one_thread))
        if proc.returncode:
            raise AssertionError(f"training failed (exit {proc.returncode}):\n{_tail(proc.stderr)}")
        text = proc.stdout
    else:
        text = run_command(ranks, command, timeout=timeout, one_thread=one_thread)
    records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    if out is None:
        return records, None
    from minipar.safetensors_io import read_safetensors

    return records, read_safetensors(os.path.join(out, "model.safetensors"))[0]


def assert_same_training(result: tuple, reference: tuple, rtol: float = 1e-9) -> None:
    """Two ``train_cli`` results: the same per-step losses and final parameters (float64: rtol 1e-9)."""
    (records, params), (ref_records, ref_params) = result, reference
    np.testing.assert_allclose([r["loss"] for r in records if "loss" in r],
                               [r["loss"] for r in ref_records if "loss" in r], rtol=rtol)
    assert params.keys() == ref_params.keys()
    for name, value in ref_params.items():
        assert params[name].shape == value.shape, name
        np.testing.assert_allclose(params[name], value, rtol=rtol, atol=1e-12, err_msg=name)


def _tail(text: str, limit: int = 6000) -> str:
    return text if len(text) <= limit else "...\n" + text[-limit:]


def _rank_main(path: str, name: str, args_json: str) -> None:
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # as pytest does: the test's folder is importable
    try:
        spec = importlib.util.spec_from_file_location(f"_rank_target_{rank}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        getattr(module, name)(*json.loads(args_json))
    except BaseException:  # noqa: BLE001 (any failure on any rank must end every rank)
        sys.stdout.flush()
        print(f"[rank {rank}] {name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(1)


if __name__ == "__main__":
    _rank_main(*sys.argv[1:4])
