"""stalwart: fault-tolerant PyTorch training on Ray.

The Python API beside the `stalwart` command (docs/architecture.md, "Packaging"):

    import stalwart

    spec = stalwart.load_spec("job.yaml", ["steps=500"])  # SpecError names each bad field
    result = stalwart.run_job(spec, stalwart.RunOptions(output="runs/nightly"))
    print(result["status"], result["model_digest"])

and, for annotations in a train loop, ``def train_loop(ctx: stalwart.TrainContext)``.
Names are imported on first use, so ``import stalwart`` imports neither torch nor Ray.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

# In a source checkout this folder stands beside orchestrator/, health/, ckpt/, ... rather
# than holding them (installed, they are inside it). Ray adds the driver's working directory
# to its workers' import path, so a job started from a checkout imports `stalwart` from here
# even when stalwart is installed: look beside it too.
_here = Path(__file__).resolve().parent
if (
    not (_here / "orchestrator").is_dir()
    and (_here.parent / "orchestrator" / "__init__.py").is_file()
):
    __path__.append(str(_here.parent))

try:
    __version__ = version("stalwart")
except PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"

# name -> the module that defines it
_API = {
    "run_job": "stalwart.orchestrator.driver",
    "RunOptions": "stalwart.orchestrator.driver",
    "ClusterUnreachable": "stalwart.orchestrator.driver",
    "JobAlreadyRunning": "stalwart.orchestrator.driver",
    "SupervisorLost": "stalwart.orchestrator.driver",
    "JobSpec": "stalwart.orchestrator.spec",
    "SpecError": "stalwart.orchestrator.spec",
    "load_spec": "stalwart.orchestrator.spec",
    "validate": "stalwart.orchestrator.spec",
    "TrainContext": "stalwart.orchestrator.worker.context",
    "Epochs": "stalwart.orchestrator.worker.data",
    "UnsupportedDependency": "stalwart.orchestrator.compat",
}

__all__ = [
    "ClusterUnreachable",
    "Epochs",
    "JobAlreadyRunning",
    "JobSpec",
    "RunOptions",
    "SpecError",
    "SupervisorLost",
    "TrainContext",
    "UnsupportedDependency",
    "__version__",
    "load_spec",
    "run_job",
    "validate",
]

if TYPE_CHECKING:
    from stalwart.orchestrator.compat import UnsupportedDependency
    from stalwart.orchestrator.driver import (
        ClusterUnreachable,
        JobAlreadyRunning,
        RunOptions,
        SupervisorLost,
        run_job,
    )
    from stalwart.orchestrator.spec import JobSpec, SpecError, load_spec, validate
    from stalwart.orchestrator.worker.context import TrainContext
    from stalwart.orchestrator.worker.data import Epochs


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'stalwart' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
