"""The reliability suite (issue 8): crashes, corruption, faults, bad input, isolation, load.

Two sizes. The default (CI, ``make test``) runs every test briefly; ``KVSTORE_RELIABILITY=long``
runs the long versions (20+ SIGKILLs, minutes of load, larger stores) and is how the figures
of ``docs/reliability.md`` are made::

    KVSTORE_RELIABILITY=long KVSTORE_RELIABILITY_OUT=figures.json \\
        .venv/bin/python -m pytest tests/reliability -q

Tests report figures (counts, latencies, restart times) with the ``figures`` fixture; they are
printed at the end of the run and written as JSON to ``$KVSTORE_RELIABILITY_OUT`` when set.
Latencies are reported, never asserted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.kvstore.conftest import start_daemon  # noqa: F401 (fixtures reused: in-process daemons,
from tests.kvstore.test_full_disk import tiny_fs  # noqa: F401  and a 1 MiB tmpfs, skipped where mount is refused)
from tests.reliability.harness import LONG

_FIGURES: dict[str, dict[str, Any]] = {}


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Iterator[Callable[..., None]]:
    """``figures(name=value, ...)``: record figures of this test for the end-of-run report."""
    mine: dict[str, Any] = {}

    def record(**values: Any) -> None:
        mine.update(values)

    yield record
    if mine:
        _FIGURES[request.node.name] = mine


_CONFIG: list[pytest.Config] = []


def pytest_configure(config: pytest.Config) -> None:
    _CONFIG[:] = [config]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """In the long run, a failure's traceback as it happens, on the terminal and (with
    ``KVSTORE_RELIABILITY_OUT``) in ``<out>.failures.txt``: pytest prints them only at the end,
    and a long run cut short before it (a test_fairness failure once) left no traceback."""
    if not (LONG and report.failed and _CONFIG):
        return
    text = f"FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n"
    tr = _CONFIG[0].pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line("")
        tr.write_line(text)
    out = os.environ.get("KVSTORE_RELIABILITY_OUT")
    if out:
        with open(out + ".failures.txt", "a") as f:
            f.write(text)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _FIGURES:
        return
    terminalreporter.section(f"reliability figures ({'long' if LONG else 'short'} run)")
    for test, values in _FIGURES.items():
        terminalreporter.write_line(f"{test}: {json.dumps(values, sort_keys=True)}")
    out = os.environ.get("KVSTORE_RELIABILITY_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({"mode": "long" if LONG else "short", "figures": _FIGURES}, f, indent=1, sort_keys=True)
