"""`stalwart checkpoint export`: a durable checkpoint's state dicts in standard formats
(ckpt/export.py; docs/checkpoints.md, "Keeping the result").

Exit codes: 0 written, 1 the checkpoint could not be read or the export not written (a
corrupt or truncated shard, storage failing after retries, a full disk), 2 our input is
wrong (no such directory, a run without a durable tier, an unknown step or rank, a non-empty
OUT). Errors are one line on stderr, starting with `error:`. torch is imported only when the
command runs, so `stalwart --help` stays quick.
"""

from __future__ import annotations

import json
import os
import sys
from typing import NoReturn

import click
from rich.text import Text

from stalwart.orchestrator.cli_conventions import (
    EXIT_FAILED,
    EXIT_USAGE,
    format_option,
    make_console,
)


def _say(kind: str, style: str, message: str) -> None:
    make_console(stderr=True).print(
        Text.assemble((f"{kind}:", style), " ", " ".join(message.split())),
        highlight=False,
        soft_wrap=True,
    )


def _fail(message: str, code: int) -> NoReturn:
    _say("error", "red", message)
    sys.exit(code)


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def checkpoint() -> None:
    """Durable checkpoints: export one into standard formats."""


@checkpoint.command("export", short_help="Write a durable checkpoint's state dicts into OUT.")
@click.argument("source", metavar="SOURCE")
@click.argument("out", metavar="OUT")
@click.option(
    "--format",
    "export_format",
    type=click.Choice(["torch", "safetensors"]),
    required=True,
    help="torch: OBJECT.pt for torch.load(weights_only=True); safetensors: "
    "OBJECT.safetensors (tensors by dotted key, other values as JSON metadata)",
)
@click.option(
    "--step",
    type=click.IntRange(min=0),
    default=None,
    help="the step to export (default: the newest one that reads back intact)",
)
@click.option(
    "--rank",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="whose shard: ranks differ only with sharded state (a ZeRO optimizer's partition)",
)
@click.option(
    "--job",
    metavar="NAME",
    default=None,
    help="the job's name, when SOURCE is a durable URI holding several jobs' checkpoints",
)
@format_option("json: print the export's manifest.json")
def export_command(
    source: str,
    out: str,
    export_format: str,
    step: int | None,
    rank: int,
    job: str | None,
    fmt: str,
) -> None:
    """Write the registered objects' state dicts of a durable checkpoint into OUT (a new or
    empty directory): OBJECT.pt or OBJECT.safetensors each, and manifest.json.

    SOURCE is a durable URI (checkpoint.persist.uri, a path or an fsspec URL, or its
    URI/JOB directory) or a RUN_DIR of `stalwart run` (its result.json names the job and
    the durable URI). Only durable checkpoints can be exported: in-memory ones die with the
    job.
    """
    from stalwart.ckpt.durable import CorruptCheckpoint, DurableError
    from stalwart.ckpt.export import ExportError, ExportFailed, export

    try:
        doc = export(source, out, export_format, step=step, rank=rank, job=job)
    except ExportError as e:
        _fail(str(e), EXIT_USAGE)
    except (CorruptCheckpoint, DurableError, ExportFailed) as e:
        _fail(str(e), EXIT_FAILED)
    for skipped in doc["skipped_steps"]:
        _say("warning", "yellow", f"skipped step {skipped['step']}: {skipped['reason']}")
    if fmt == "json":
        click.echo(json.dumps(doc, indent=2))
        return
    click.echo(
        f"exported step {doc['step']} of job {doc['job']} (rank {doc['rank']} of "
        f"{doc['world_size']}) from {doc['source']} as {doc['format']}:"
    )
    for name, obj in doc["objects"].items():
        path = os.path.join(out, obj["file"])
        what = f"{obj['tensors']} tensors, {_size(obj['bytes'])}"
        if obj["stripped_prefix"]:
            what += f", prefix {obj['stripped_prefix']!r} stripped"
        if obj["converted"]:
            what += f", {len(obj['converted'])} values converted (see manifest.json)"
        click.echo(f"  {path}  {name}: {what}")
    click.echo(f"  {os.path.join(out, 'manifest.json')}")
    first = next(iter(doc["objects"].values()), None)
    if first is not None:
        path = os.path.join(out, first["file"])
        load = (
            f"torch.load({path!r}, weights_only=True)"
            if doc["format"] == "torch"
            else f"safetensors.torch.load_file({path!r})"
        )
        click.echo(f"load with {load}")
