"""Low-level modules never import high-level ones, and the only import cycle is the documented one
(autograd ↔ ops, see autograd's docstring). Reads every import statement, lazy ones included."""
import ast
import os

import minipar

ROOT = os.path.dirname(minipar.__file__)
KERNELS = os.path.join(os.path.dirname(ROOT), "kernels")

# each module's layer; a module may import only modules of its own layer or below
LAYERS = [
    ["minipar.backend", "minipar.safetensors_io", "minipar.kernels"],
    ["minipar.autograd", "minipar.ops", "minipar.comm", "minipar.precision", "minipar"],  # minipar: the package's __init__
    ["minipar.nn", "minipar.placement", "minipar.trace", "minipar.data", "minipar.optim"],
    ["minipar.models"],
    ["minipar.parallel"],
    ["minipar.checkpoint", "minipar.plot"],
    ["minipar.cli"],
    ["minipar.train", "minipar.testing", "minipar.launch", "minipar.figures", "minipar.__main__"],
]
ALLOWED_CYCLES = {frozenset({"minipar.autograd", "minipar.ops"})}


def _layer(module: str) -> int:
    matches = [(len(prefix), i) for i, layer in enumerate(LAYERS) for prefix in layer
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} has no layer in tests/test_layering.py: place it"
    return max(matches)[1]


def _modules() -> dict[str, str]:
    found = {}
    for base, package in ((ROOT, "minipar"), (KERNELS, "minipar.kernels")):
        for folder, _, files in os.walk(base):
            for file in files:
                if file.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, file), base)[:-3].replace(os.sep, ".")
                    name = package if rel == "__init__" else f"{package}.{rel.removesuffix('.__init__')}"
                    found[name] = os.path.join(folder, file)
    return found


def _imports(path: str, package: str, modules: dict[str, str]) -> set[str]:
    """The minipar modules that ``path`` imports (``from pkg import mod`` counts as mod, not pkg)."""
    names = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return {n for n in names if n.startswith("minipar")}


def test_no_upward_imports_and_no_cycles():
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
        graph[name] = {m for m in _imports(path, package, modules) if m in modules and m != name}
    upward = [f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
              for a, deps in graph.items() for b in deps if _layer(b) > _layer(a)]
    assert not upward, "\n".join(upward)
    cycles = {frozenset({a, b}) for a, deps in graph.items() for b in deps if a in graph.get(b, ())}
    assert cycles <= ALLOWED_CYCLES, cycles - ALLOWED_CYCLES


def test_kernels_install_inside_minipar():
    import importlib.util

    assert importlib.util.find_spec("minipar.kernels") is not None
    assert os.path.dirname(importlib.util.find_spec("minipar.kernels").origin) == KERNELS


def test_the_kernels_folder_never_shadows_an_installed_kernels_package(tmp_path):
    """Python started in the repository root finds ./kernels first for ``import kernels`` (transformers imports the
    PyPI package of that name). The folder steps aside: an installed `kernels` is what the import returns, and
    with none installed the import yields an empty namespace-like module, not minipar's kernels; minipar.kernels
    imports as always."""
    import subprocess
    import sys

    repo = os.path.dirname(KERNELS)
    site = tmp_path / "site" / "kernels"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("FROM = 'the installed package'\n")
    probe = "import kernels, minipar.kernels.adapter; print(getattr(kernels, 'FROM', None), kernels.__file__)"
    run = lambda env: subprocess.run([sys.executable, "-c", probe], cwd=repo, capture_output=True, text=True,  # noqa: E731
                                     timeout=60, env={**os.environ, **env})
    installed = run({"PYTHONPATH": str(tmp_path / "site")})
    assert installed.returncode == 0 and installed.stdout.split(" ", 3)[:3] == ["the", "installed", "package"], \
        installed.stderr
    outside = subprocess.run([sys.executable, "-c", "import importlib.util as u; s = u.find_spec('kernels'); "
                              "print(s.origin if s else None)"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=60, env={**os.environ, "PYTHONPATH": ""})
    alone = run({"PYTHONPATH": ""})  # the same as from anywhere else: the installed one (transformers') or none
    assert alone.returncode == 0 and alone.stdout.split()[-1] == outside.stdout.strip(), alone.stdout + alone.stderr
