"""Chaos tests share the component tests' fixtures: the session's multi-node Ray; and one
baseline cache for the session, so each job's failure-free run happens once whichever
cluster first needs it (a model does not depend on the cluster it trained on)."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("chaos-cache")
