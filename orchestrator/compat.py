"""The versions of torch and Ray stalwart supports, checked where they are first used.

pyproject.toml states the ranges; this module makes an unsupported install fail at once with
one clear line instead of deep inside a recovery. Besides the version, it checks the
private torch.distributed helpers stalwart's recoverable process group relies on
(worker/collective.py) and the Ray APIs its placement relies on (supervisor/slots.py,
supervisor/pool.py), so a release that renames one is named in the error.

STALWART_ALLOW_UNTESTED_VERSIONS=1 in the environment turns the version floor (TORCH_MIN,
RAY_MIN) into a warning, for trying stalwart on an older torch or Ray than it was tested
with (a machine whose torch cannot be changed). Only the floor: a missing package, and the
private-API checks below, still raise.
"""

from __future__ import annotations

import inspect
import os
import re
import warnings
from importlib.metadata import PackageNotFoundError, version

TORCH_MIN = (2, 13)
RAY_MIN = (2, 55)
# Set to 1 (or true, yes): an installed version below the floor warns instead of raising.
ALLOW_UNTESTED_ENV = "STALWART_ALLOW_UNTESTED_VERSIONS"
# torch.distributed.distributed_c10d's private helpers: name -> parameters used
TORCH_PRIVATE = {
    "_register_pg_in_world": (
        "backend_name",
        "store",
        "group_name",
        "backend_config",
        "rank_mapping",
        "add_to_default_tag",
    ),
    "_cleanup_process_group_global_state": (),
    "_update_default_pg": (),
    "_register_process_group": (),
    "_unregister_process_group": (),
}


class UnsupportedDependency(ImportError):
    """An installed torch or Ray that stalwart does not support."""


class UntestedDependency(UserWarning):
    """An installed torch or Ray below the tested floor, let through by ALLOW_UNTESTED_ENV."""


def allow_untested() -> bool:
    """ALLOW_UNTESTED_ENV is set: versions below the floor warn instead of raising."""
    return os.environ.get(ALLOW_UNTESTED_ENV, "").strip().lower() in ("1", "true", "yes")


def _parse(text: str) -> tuple[int, ...]:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _installed(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _require_version(dist: str, minimum: tuple[int, int], extra: str = "") -> str:
    """The installed version of `dist`; UnsupportedDependency when it is older than
    `minimum` (a warning instead with ALLOW_UNTESTED_ENV set) or missing."""
    found = _installed(dist)
    least = ".".join(map(str, minimum))
    if found is not None and _parse(found) < minimum and allow_untested():
        warnings.warn(
            f"stalwart is tested with {dist} >= {least}, found {found}: running anyway "
            f"({ALLOW_UNTESTED_ENV} is set)",
            UntestedDependency,
            stacklevel=3,
        )
        return found
    if found is None or _parse(found) < minimum:
        raise UnsupportedDependency(
            f"stalwart needs {dist} >= {least}, found {found or 'none'}: "
            f"pip install '{dist}{extra}>={least}'"
        )
    return found


def require_torch() -> None:
    """Raise UnsupportedDependency unless torch is new enough and has the private helpers."""
    found = _require_version("torch", TORCH_MIN)
    import torch.distributed.distributed_c10d as c10d

    for name, params in TORCH_PRIVATE.items():
        fn = getattr(c10d, name, None)
        missing = (
            ()
            if fn is None
            else tuple(p for p in params if p not in inspect.signature(fn).parameters)
        )
        if fn is None or missing:
            what = "is missing" if fn is None else f"takes no {', '.join(missing)}"
            raise UnsupportedDependency(
                f"torch {found}: torch.distributed.distributed_c10d.{name} {what}; stalwart's "
                f"recoverable process group needs it (tested: torch "
                f"{'.'.join(map(str, TORCH_MIN))} and newer 2.x with it)"
            )
    # Subgroups (DeviceMesh dimensions) are stalwart's only where torch hands new_group to
    # a default group that implements it (worker/torch_group.py).
    helper = getattr(c10d, "_new_group_with_tag", None)
    if helper is None or "default_pg.new_group" not in inspect.getsource(helper):
        raise UnsupportedDependency(
            f"torch {found}: torch.distributed.new_group does not hand subgroup creation to "
            "the default group; stalwart's abortable DeviceMesh groups need it (tested: "
            f"torch {'.'.join(map(str, TORCH_MIN))})"
        )
    if not hasattr(c10d, "_world") or not hasattr(c10d._world, "default_pg"):
        raise UnsupportedDependency(
            f"torch {found}: torch.distributed.distributed_c10d._world.default_pg is missing; "
            "stalwart's recoverable process group needs it"
        )


def require_ray() -> None:
    """Raise UnsupportedDependency unless Ray is new enough and has the placement APIs."""
    found = _require_version("ray", RAY_MIN, extra="[default]")
    from ray.util import placement_group, scheduling_strategies

    if "bundle_label_selector" not in inspect.signature(placement_group).parameters:
        raise UnsupportedDependency(
            f"ray {found}: ray.util.placement_group takes no bundle_label_selector; stalwart "
            "pins each slot to its node with it"
        )
    for name in ("NodeLabelSchedulingStrategy", "NotIn", "NodeAffinitySchedulingStrategy"):
        if not hasattr(scheduling_strategies, name):
            raise UnsupportedDependency(
                f"ray {found}: ray.util.scheduling_strategies.{name} is missing"
            )
