"""Packaging: ranges in pyproject.toml, the exact versions in constraints.txt, every package and
data file in the wheel, one `stalwart.` namespace, the version checks at import, and clear
errors for a missing extra."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from stalwart.orchestrator import compat

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
ROOTS = {
    "stalwart": "stalwart",
    **{f"stalwart.{p}": p for p in ("orchestrator", "health", "ckpt", "dashboards", "examples")},
}


def _requirements() -> list[Requirement]:
    project = PYPROJECT["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        reqs += [Requirement(r) for r in extra]
    return reqs


def _constraints() -> dict[str, str]:
    out = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, ver = line.partition("==")
            assert ver, f"constraints.txt: {line!r} is not an exact pin"
            out[re.sub(r"[-_.]+", "-", name).lower()] = ver
    return out


def test_dependencies_are_ranges_and_constraints_pin_each_of_them():
    pins = _constraints()
    for req in _requirements():
        assert not any(s.operator in ("==", "===") for s in req.specifier), (
            f"pyproject.toml pins {req}: state the supported range, pin in constraints.txt"
        )
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        assert name in pins, f"constraints.txt has no pin for {req.name}"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {req.name}=={pins[name]}, outside pyproject's {req}"
        )
    assert pins["torch"] == "2.13.0"  # the CPU build on this machine's disk


def test_the_readme_commands_and_ci_install_from_the_constraints():
    venv = (REPO / "scripts" / "venv.sh").read_text()
    assert "-c constraints.txt" in venv
    assert "venv.sh" in (REPO / "scripts" / "test.sh").read_text()
    assert "venv.sh" in (REPO / "scripts" / "quickstart.sh").read_text()


def test_every_package_folder_is_in_the_wheel_under_stalwart():
    setuptools = PYPROJECT["tool"]["setuptools"]
    assert setuptools["package-dir"] == ROOTS
    found = set()
    for name, folder in ROOTS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            found.add(".".join([name, *rel.parts]))
    listed = set(setuptools["packages"])
    assert found - listed == set(), "packages missing from pyproject.toml's packages"
    # Data folders are listed as packages too (setuptools warns about them otherwise).
    assert listed - found <= {
        "stalwart.dashboards.grafana",
        "stalwart.dashboards.prometheus",
        "stalwart.dashboards.rules",
        "stalwart.dashboards.rules.tests",
    }


def test_no_top_level_name_but_stalwart_is_imported():
    # Every import of the project's own code goes through the `stalwart.` namespace: a bare
    # `import health` would be another distribution's (or none) once installed.
    bare = re.compile(r"^\s*(?:from|import) (orchestrator|health|ckpt|dashboards|examples)\b", re.M)
    offenders = [
        str(p.relative_to(REPO))
        for folder in ("stalwart", *ROOTS.values(), "tests", "bench")
        for p in (REPO / folder).rglob("*.py")
        if bare.search(p.read_text())
    ]
    assert offenders == []


def test_supported_versions_pass_the_checks():
    compat.require_torch()
    compat.require_ray()


def test_an_old_torch_or_ray_is_refused_with_the_version_to_install(monkeypatch):
    monkeypatch.setattr(compat, "_installed", lambda dist: "2.12.1")
    with pytest.raises(compat.UnsupportedDependency, match=r"torch >= 2\.13, found 2\.12\.1"):
        compat.require_torch()
    with pytest.raises(compat.UnsupportedDependency, match=r"ray >= 2\.55, found 2\.12\.1"):
        compat.require_ray()


def test_a_torch_without_the_private_helpers_is_named(monkeypatch):
    import torch.distributed.distributed_c10d as c10d

    monkeypatch.delattr(c10d, "_register_pg_in_world")
    with pytest.raises(compat.UnsupportedDependency, match="_register_pg_in_world is missing"):
        compat.require_torch()


def test_a_ray_without_bundle_label_selectors_is_named(monkeypatch):
    import ray.util

    monkeypatch.setattr(ray.util, "placement_group", lambda bundles, strategy="PACK": None)
    with pytest.raises(compat.UnsupportedDependency, match="bundle_label_selector"):
        compat.require_ray()


def test_report_without_matplotlib_says_which_extra_to_install(tmp_path):
    # In a fresh interpreter: this one has imported matplotlib and the figures already.
    script = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from stalwart.orchestrator.observe.report import build_report\n"
        "from stalwart.orchestrator.observe.rundir import ReportError\n"
        "try:\n"
        f"    build_report({str(REPO / 'tests' / 'unit' / 'data' / 'report_run')!r}, "
        f"{str(tmp_path / 'out')!r})\n"
        "except ReportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "pip install 'stalwart[report]'" in out.stdout, out.stdout


def test_push_without_grafana_client_says_which_extra_to_install(monkeypatch):
    from stalwart.dashboards.provision import ConfigError, push

    monkeypatch.setitem(sys.modules, "grafana_client", None)
    with pytest.raises(ConfigError, match=r"pip install 'stalwart\[grafana\]'"):
        push("http://127.0.0.1:9/", "a-token")


@pytest.mark.timeout(300)
def test_a_built_wheel_carries_its_data_and_runs_outside_the_repository(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dist),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        timeout=240,
    )
    (wheel,) = dist.glob("stalwart-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for data in (
        "stalwart/examples/quickstart.yaml",
        "stalwart/examples/gpt/train.py",
        "stalwart/dashboards/rules/stalwart.rules.yml",
        "stalwart/dashboards/rules/tests/alerts.test.yml",
        "stalwart/dashboards/prometheus/scrape.yml",
        "stalwart/dashboards/grafana/job-overview.json",
        "stalwart/orchestrator/supervisor/actor.py",
        "stalwart/py.typed",
    ):
        assert data in names, f"{data} missing from {wheel.name}"
    tops = {n.split("/")[0] for n in names if not n.startswith("stalwart-")}
    assert tops == {"stalwart"}, f"top-level names in the wheel: {sorted(tops)}"
    # Installed alone into a folder (its dependencies come from this venv), run from outside
    # the repository: the packaged quickstart spec validates, its entrypoint imports.
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    probe = (
        "import stalwart, stalwart.examples.gpt.train as t, stalwart.orchestrator.cli as c;"
        "print(stalwart.__file__); print(t.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert all(line.startswith(str(target)) for line in out.stdout.split()), out.stdout
    shown = subprocess.run(
        [sys.executable, "-m", "stalwart.orchestrator.cli", "quickstart", "--show"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert "entrypoint: stalwart.examples.gpt.train:train_loop" in shown.stdout
