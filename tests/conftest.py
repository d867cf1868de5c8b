"""Test-session settings.

Triton kernels run in Triton's numpy interpreter: TRITON_INTERPRET must be set before triton is first imported.

The fast subset, ``python -m pytest -m "not slow"``: every test function runs once, with its first parameter set;
the other parameter sets (more ranks, more layouts, more schedules) and the tests marked ``@pytest.mark.slow``
make up the rest of the full suite, which CI runs."""
import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seen: set[tuple[str, str]] = set()
    for item in items:
        function = (str(item.path), item.originalname)
        if function in seen:
            item.add_marker(pytest.mark.slow)
        seen.add(function)
