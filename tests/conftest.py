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
