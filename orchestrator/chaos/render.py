"""A verdict for people (a terminal table) and for CI systems (JUnit XML)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from stalwart.orchestrator.chaos.verdict import Verdict
from stalwart.orchestrator.chaos.verdict import seconds as _s


def _tiers(t: dict[str, int]) -> str:
    """{"memory": 3, "peer": 1} -> "memory x3, peer"."""
    return ", ".join(f"{k} x{n}" if n > 1 else k for k, n in sorted(t.items())) or "-"


def table(v: Verdict) -> Any:
    """The verdict as a rich renderable: one row per fault, then the checks, then PASS/FAIL."""
    faults = Table(title=f"chaos scenario {v.scenario}", title_justify="left")
    for col, just in (
        ("#", "right"),
        ("fault", "left"),
        ("outcome", "left"),
        ("detected", "right"),
        ("recovered", "right"),
        ("lost", "right"),
        ("restored from", "left"),
    ):
        faults.add_column(col, justify=just)
    for r in v.faults:
        if r.failures:
            restored = (
                f"step {r.restored_step}, {_tiers(r.tiers)}"
                if r.restored_step or not r.steps_lost
                else "nothing: step 0"
            )
        else:
            restored = r.noticed or "-"
        outcome = r.outcome.partition(":")[0]  # the reason is in the checks
        faults.add_row(
            str(r.index),
            f"{r.kind} {r.label}",
            outcome,
            _s(r.detected_after_s),
            _s(r.recovered_after_s),
            "-" if r.steps_lost is None else str(r.steps_lost),
            restored,
        )
    checks = Table(title="expectations", title_justify="left")
    checks.add_column("check")
    checks.add_column("")
    checks.add_column("detail")
    for c in v.checks:
        checks.add_row(c.name, Text("ok", "green") if c.ok else Text("FAIL", "bold red"), c.detail)
    word = Text("PASS", "bold green") if v.passed else Text("FAIL", "bold red")
    failed = sum(not c.ok for c in v.checks)
    line = Text.assemble(
        word,
        f"  {v.scenario}: {len(v.checks) - failed}/{len(v.checks)} checks, status {v.status}, "
        f"{v.steps} steps in {_s(v.wall_seconds)}",
    )
    return Group(faults, checks, line)


def junit(verdicts: list[Verdict]) -> str:
    """JUnit XML: a testsuite per scenario, a testcase per check (failed ones with a
    <failure>), the fault table in the suite's system-out."""
    root = ET.Element("testsuites", name="stalwart chaos")
    total = failures = 0
    for v in verdicts:
        bad = sum(not c.ok for c in v.checks)
        suite = ET.SubElement(
            root,
            "testsuite",
            name=v.scenario,
            tests=str(len(v.checks)),
            failures=str(bad),
            errors="0",
            time=f"{v.wall_seconds or 0:.3f}",
        )
        for c in v.checks:
            case = ET.SubElement(suite, "testcase", classname=f"chaos.{v.scenario}", name=c.name)
            if not c.ok:
                ET.SubElement(case, "failure", message=c.detail[:500]).text = c.detail
        out = ET.SubElement(suite, "system-out")
        out.text = "\n".join(
            f"fault {r.index} {r.kind} {r.label}: {r.outcome}; "
            f"detected after {_s(r.detected_after_s)}, recovered after "
            f"{_s(r.recovered_after_s)}, steps lost {r.steps_lost}, restored step "
            f"{r.restored_step} from {_tiers(r.tiers)}"
            for r in v.faults
        )
        total += len(v.checks)
        failures += bad
    root.set("tests", str(total))
    root.set("failures", str(failures))
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
