"""Render every tutorial as a page of the documentation site: its docstring as text, its code, and what it printed
when it last ran — so a learner reads the output beside the code without running it.

    python docs/render_tutorials.py            # runs each tutorial as its docstring says (mpiexec -n K …), writes
                                               # docs/tutorials/NN_name.md

A tutorial's rank count is read from the command in its own docstring (``mpiexec -n 4 python tutorials/…``).
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from minipar.testing import RANK_ENV, mpiexec

ROOT = Path(__file__).resolve().parent.parent


def ranks_of(docstring: str) -> int:
    """The -n of the first command in the tutorial's docstring, ``mpiexec -n K python tutorials/…`` (1: plain python)."""
    found = re.search(r"(?:mpiexec -n (\d+) )?python tutorials/", docstring)
    return int(found.group(1)) if found and found.group(1) else 1


def render(path: Path) -> str:
    source = path.read_text(encoding="utf-8")
    module = ast.parse(source)
    docstring = ast.get_docstring(module) or path.stem
    code = "\n".join(source.splitlines()[module.body[0].end_lineno:]).strip("\n")
    ranks = ranks_of(docstring)
    command = [sys.executable, str(path)] if ranks == 1 else [mpiexec(), "-n", str(ranks), sys.executable, str(path)]
    started = time.perf_counter()
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, **RANK_ENV})
    if run.returncode != 0:
        raise RuntimeError(f"{path.name} failed:\n{run.stdout}{run.stderr}")
    title, _, body = docstring.partition("\n")
    shown = f"mpiexec -n {ranks} python tutorials/{path.name}" if ranks > 1 else f"python tutorials/{path.name}"
    print(f"{path.name}: {ranks} rank(s), {time.perf_counter() - started:.1f} s", flush=True)
    return (f"# {title.strip()}\n\n{body.strip()}\n\n"
            f"Run it with `{shown}` (tutorials/{path.name}).\n\n## The code\n\n```python\n{code}\n```\n\n"
            f"## What it prints\n\n```text\n{run.stdout.rstrip()}\n```\n")


def main() -> None:
    out = ROOT / "docs" / "tutorials"
    out.mkdir(exist_ok=True)
    for path in sorted((ROOT / "tutorials").glob("[0-9]*.py")):
        (out / f"{path.stem}.md").write_text(render(path), encoding="utf-8")


if __name__ == "__main__":
    main()
