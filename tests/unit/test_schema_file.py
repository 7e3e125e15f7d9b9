"""The committed JSON Schema (docs/job-spec.schema.json) matches the code."""

import json
from pathlib import Path

from stalwart.orchestrator.spec import json_schema

SCHEMA = Path(__file__).resolve().parents[2] / "docs" / "job-spec.schema.json"


def test_committed_schema_is_current():
    committed = json.loads(SCHEMA.read_text())
    assert committed == json_schema(), (
        "docs/job-spec.schema.json is stale: run `stalwart schema > docs/job-spec.schema.json`"
    )
