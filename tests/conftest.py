"""One multi-node Ray (tests/component/multinode.py) for every module that needs one, the
component tests' and the chaos tests': each module sizes it to what it needs
(`ensure_worker_nodes`), and it is stopped after the last. Its head runs no log monitor, so
nothing on it grows with the jobs it has run."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def multinode():
    from tests.component.multinode import MultiNode

    mn = MultiNode()
    try:
        yield mn
    finally:
        mn.shutdown()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failure is printed as it happens, besides pytest's summary at the end: a run that
    CI stops at its time limit never reaches the summary, and still shows why a test
    failed (the last lines of the report: the assertion and its values)."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    terminal = item.config.pluginmanager.get_plugin("terminalreporter")
    if terminal is None:
        return
    lines = report.longreprtext.splitlines()
    terminal.write_line("")
    terminal.write_sep("-", f"FAILED {item.nodeid} ({report.when}), as it happened")
    for line in lines[-60:]:
        terminal.write_line(line[:400])
