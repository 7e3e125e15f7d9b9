"""A DCP checkpoint directory anywhere (a local path or an fsspec URL), opened for reading
by ``checkpoint.init_from``: a stalwart step directory (read through its manifest) or any
other DCP checkpoint (a torchrun job's ``dcp.save``, a torchtitan step)."""

from __future__ import annotations

import posixpath
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from stalwart.ckpt import dcp_format
from stalwart.ckpt.dcp_format import CheckpointMismatch
from stalwart.ckpt.durable import _join, parse_uri
from stalwart.ckpt.manifest import MANIFEST_NAME, Manifest


def dcp_reader(uri: str) -> tuple[Any, str]:
    """A reader of the DCP checkpoint directory at `uri` (a stalwart step directory, read
    through its manifest; or any other, through its ``.metadata`` and the allow-list) and
    the directory as shown in messages. CheckpointMismatch or OSError say what is wrong."""
    from stalwart.ckpt.dcp_read import StepReader, read_foreign_metadata

    fs, root = parse_uri(uri)
    where = root if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(root)

    def read(file: str, offset: int, length: int) -> bytes:
        if posixpath.basename(file) != file or file in ("", ".", ".."):
            raise CheckpointMismatch(f"{where}: its index names an unsafe file {file!r}")
        with fs.open(_join(root, file), "rb") as f:
            f.seek(offset)
            data = f.read(length)
        if len(data) != length:
            raise CheckpointMismatch(f"{where}: {file} is truncated")
        return data

    try:
        manifest_raw = fs.cat_file(_join(root, MANIFEST_NAME))
    except FileNotFoundError:
        manifest_raw = None
    if manifest_raw is not None:
        try:
            m = Manifest.from_json(manifest_raw)
        except ValueError as e:
            raise CheckpointMismatch(f"{where}: unparsable {MANIFEST_NAME}: {e}") from None
        if m.dcp is None:
            raise CheckpointMismatch(f"{where}: a stalwart step of format 1, not a DCP checkpoint")
        entries, planner = m.dcp["entries"], m.dcp["planner_data"]
        return StepReader(read, where, entries=entries, planner_data=planner), where
    try:
        raw = fs.cat_file(_join(root, dcp_format.METADATA_NAME))
    except FileNotFoundError:
        raise CheckpointMismatch(
            f"{where} is not a DCP checkpoint: it has no {dcp_format.METADATA_NAME}"
        ) from None
    return StepReader(read, where, metadata=read_foreign_metadata(raw, where)), where
