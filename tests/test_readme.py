"""The README stays short and true: at most 300 lines, every link resolves, the reading path's line counts
are the files' (within 10%), every page of docs/ is reachable from the README and from the docstring of the
code it explains, .ci/run runs exactly the README's test command, and the composition table is Layout's."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_is_short():
    assert len(README.splitlines()) <= 300


def test_every_link_resolves():
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if "://" not in target:
            assert (ROOT / target).exists(), target
    for page in (ROOT / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([^)#]+)\)", page.read_text(encoding="utf-8")):
            if "://" not in target:
                assert (page.parent / target).exists(), (page.name, target)


def test_reading_path_line_counts():
    """A reading-time estimate, not a checksum: within 10% of the file's length, so edits need not touch the
    README until a file has grown or shrunk noticeably."""
    rows = re.findall(r"^\| \d+ \| \[([^]]+)\]\(([^)]+)\) \| (\d+) \|", README, flags=re.M)
    assert len(rows) >= 20
    for name, path, stated in rows:
        actual = len((ROOT / path).read_text(encoding="utf-8").splitlines())
        assert abs(actual - int(stated)) <= 0.1 * actual, f"{path}: README says {stated} lines, it has {actual}"


def test_every_docs_page_is_linked_from_the_readme_and_the_code():
    sources = "\n".join(p.read_text(encoding="utf-8") for folder in ("minipar", "kernels", "benchmarks")
                        for p in (ROOT / folder).rglob("*.py"))
    mentioned = set(re.findall(r"docs/(\w+\.md)", sources))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert mentioned <= pages, mentioned - pages  # no docstring points at a missing page
    for page in pages:
        assert f"(docs/{page})" in README, page
        assert page in mentioned, f"docs/{page} is linked from no module docstring"


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()
    assert ci[-1] == "python -m pytest -q"
    assert 'pip install -e ".[test]" && python -m pytest -q' in README


def test_the_composition_table_is_layouts():
    """README's "what composes with what" is exactly what Layout's rules say today."""
    from minipar.parallel.layout import composition_table

    table = README.split("<!-- composition table -->\n")[1].split("\n<!-- end of composition table -->")[0]
    assert table == composition_table()
    assert "✓" in table and "·" in table
