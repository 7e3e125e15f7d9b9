"""Chaos tests share the component tests' fixtures: a multi-node Ray per module."""

from tests.component.conftest import multinode  # noqa: F401 (a fixture)
