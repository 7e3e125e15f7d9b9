"""STALWART_ALLOW_UNTESTED_VERSIONS: the version floor warns instead of raising; a missing
package and the private-API checks still raise (orchestrator/compat.py)."""

from __future__ import annotations

import warnings

import pytest
import torch.distributed.distributed_c10d as c10d

from stalwart.orchestrator import compat


@pytest.fixture
def old_torch(monkeypatch):
    """torch 2.11.0 installed, as the installed-version lookup says."""
    real = compat._installed
    monkeypatch.setattr(
        compat, "_installed", lambda dist: "2.11.0+cu130" if dist == "torch" else real(dist)
    )


def test_old_torch_refused_without_the_override(old_torch, monkeypatch):
    monkeypatch.delenv(compat.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(compat.UnsupportedDependency, match=r"torch >= 2\.13, found 2\.11\.0"):
        compat.require_torch()


@pytest.mark.parametrize("value", ["0", "", "no"])
def test_other_values_do_not_override(old_torch, monkeypatch, value):
    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, value)
    with pytest.raises(compat.UnsupportedDependency):
        compat.require_torch()


@pytest.mark.parametrize("value", ["1", "true", "YES"])
def test_override_turns_the_floor_into_a_warning(old_torch, monkeypatch, value):
    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, value)
    with pytest.warns(compat.UntestedDependency, match=r"torch >= 2\.13, found 2\.11\.0"):
        compat.require_torch()


def test_override_keeps_the_private_api_checks(old_torch, monkeypatch):
    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, "1")
    monkeypatch.delattr(c10d, "_update_default_pg")
    with (
        warnings.catch_warnings(),
        pytest.raises(compat.UnsupportedDependency, match="_update_default_pg is missing"),
    ):
        warnings.simplefilter("ignore", compat.UntestedDependency)
        compat.require_torch()


def test_override_does_not_excuse_a_missing_package(monkeypatch):
    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, "1")
    monkeypatch.setattr(compat, "_installed", lambda dist: None)
    with pytest.raises(compat.UnsupportedDependency, match="found none"):
        compat._require_version("ray", compat.RAY_MIN, extra="[default]")


def test_supported_versions_do_not_warn(monkeypatch):
    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, "1")
    monkeypatch.setattr(compat, "_installed", lambda dist: "2.60.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compat._require_version("ray", compat.RAY_MIN) == "2.60.0"
