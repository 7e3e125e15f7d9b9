"""Chaos tests share the component tests' fixtures: a multi-node Ray per module; and one
baseline cache for the session, so each job's failure-free run happens once whichever
module's cluster first needs it (a model does not depend on the cluster it trained on)."""

from pathlib import Path

import pytest

from tests.component.conftest import multinode  # noqa: F401 (a fixture)


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("chaos-cache")
