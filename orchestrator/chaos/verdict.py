"""A chaos run's verdict: what each fault did to the job and whether the scenario's
expectations held. A pure function of the run's result.json, its event log, the failure-free
run's digest and (optionally) the alerts Prometheus saw fire.

Per fault: was it carried out, when was the failure it caused detected, when did every rank
train again, how many steps were redone, which tier the ranks restored from. Then one check
per expectation; the verdict passes when every check does. Every figure is read from the
job's own account (result.json's failures, the `recovered` events), the one the summary,
the report and the exporter read too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from stalwart.orchestrator.chaos import fencing
from stalwart.orchestrator.chaos.scenario import Scenario

# Kinds whose effect is not a failure of the rank: what shows that they were noticed.
_NOTICED_BY = {
    "slow": ("straggler",),
    "storage_unavailable": ("persist_failed",),
    "drop_replicas": (),
    "corrupt_shard": ("restore_source_dropped",),
    "fill_shm": ("shm_full",),
    "kill_supervisor": ("supervisor_adopted",),
}


@dataclass
class FaultRow:
    index: int
    kind: str
    rank: int
    at_step: int
    outcome: str  # "injected", "refused: ...", "not fired"
    failures: int = 0  # failure records it caused (a lost node: one per rank)
    detected_after_s: float | None = None
    recovered_after_s: float | None = None
    steps_lost: int | None = None
    restored_step: int | None = None
    tiers: dict[str, int] = field(default_factory=dict)  # restore tier -> ranks
    noticed: str | None = None  # for kinds that fail no rank: the event that shows it
    target: str | None = None  # a network fault's: "n2 (rank 1)", what it hit
    # A network fault's: when it was held, [start, end] wall clock (a flap has several).
    windows: list[list[float]] = field(default_factory=list)

    @property
    def label(self) -> str:
        """What was hit, and when: "rank 1 @30", or a network fault's node."""
        return f"{self.target or f'rank {self.rank}'} @{self.at_step}"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Verdict:
    scenario: str
    passed: bool
    status: str
    digest: str | None
    baseline_digest: str | None
    steps: int
    wall_seconds: float | None
    faults: list[FaultRow]
    checks: list[Check]
    alerts: dict[str, float] | None  # alert -> seconds after the job started it first fired
    output: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fault_rows(result: dict[str, Any], events: list[dict[str, Any]], faults: list[dict]) -> list:
    # Recalled: carried out under a supervisor that died (kill_supervisor) before its
    # events were fetched; its successor learns of it from the node agents.
    injected = {
        e["index"]: e for e in events if e.get("type") in ("fault_injected", "fault_recalled")
    }
    refused = {e["index"]: e for e in events if e.get("type") == "fault_refused"}
    rows = []
    for i, f in enumerate(faults):
        if f.get("refused"):  # a timed fault the job did not take
            outcome = f"refused: {f['refused']}"
        elif i in injected:
            outcome = "injected"
        elif i in refused:
            outcome = f"refused: {refused[i].get('reason', '')}"
        else:
            outcome = "not fired"
        # The rank that carried it out (peer_of_rank: one on the node holding the copies).
        rank = injected[i].get("rank", f["rank"]) if i in injected else f["rank"]
        row = FaultRow(i, f["kind"], rank, f["at_step"], outcome)
        mine = [x for x in result.get("failures", []) if x.get("fault_index") == i]
        row.failures = len(mine)
        if mine:
            row.detected_after_s = _worst(x.get("detected_after_s") for x in mine)
            row.recovered_after_s = _worst(x.get("recovered_after_s") for x in mine)
            row.steps_lost = _worst(x.get("steps_redone") for x in mine)
            row.restored_step = mine[0].get("restored_step")
            for x in mine[:1]:
                row.tiers = dict(x.get("restore_tiers") or {})
        elif outcome == "injected":
            row.noticed = _noticed(f, injected[i], events)
        rows.append(row)
    return rows


# A node's failure this long after its network fault healed is still that fault's (a
# cut-off node's raylet is declared dead by Ray's own health checks, later than stalwart's).
NETWORK_ATTRIBUTION_S = 60.0


def network_rows(
    result: dict[str, Any], applied: list[dict[str, Any]], first: int
) -> list[FaultRow]:
    """The rows of the network faults `stalwart chaos run` carried out (network.py's
    records), numbered from `first`: the failures of the node each hit, while it was cut
    or degraded or soon after, are its; times count from when it was applied."""
    rows = []
    for j, a in enumerate(applied):
        at_step = a.get("step") if a.get("at_step") is None else a["at_step"]
        rank = a.get("rank") if isinstance(a.get("rank"), int) else -1
        target = a.get("target")
        if target and isinstance(a.get("rank"), int):
            target = f"{target} (rank {a['rank']})"
        row = FaultRow(first + j, a["kind"], rank, -1 if at_step is None else at_step, "")
        row.outcome, row.target = a["outcome"], target
        if a["outcome"] == "injected":
            until = (a.get("healed_at") or float("inf")) + NETWORK_ATTRIBUTION_S
            mine = [
                x
                for x in result.get("failures", [])
                if _hit(a, x.get("node")) and a["at"] <= x["detected_at"] <= until
            ]
            row.failures = len(mine)
            if mine:
                row.detected_after_s = round(max(x["detected_at"] for x in mine) - a["at"], 4)
                back = [
                    x["detected_at"] + x["recovered_after_s"]
                    for x in mine
                    if x.get("recovered_after_s") is not None
                ]
                row.recovered_after_s = round(max(back) - a["at"], 4) if back else None
                row.steps_lost = _worst(x.get("steps_redone") for x in mine)
                row.restored_step = mine[0].get("restored_step")
                row.tiers = dict(mine[0].get("restore_tiers") or {})
            row.windows = [list(w) for w in a.get("windows", [])]
            held = sum(end - start for start, end in row.windows)
            row.noticed = f"{len(row.windows)} window(s), {held:.1f} s in all"
        rows.append(row)
    return rows


def _hit(applied: dict[str, Any], node: str | None) -> bool:
    """Whether an outside fault hit `node`: one of those it names, or any (node_ids None:
    a fault of the cluster's head, such as restart_gcs)."""
    ids = applied.get("node_ids", ())
    return ids is None or node in ids


def _worst(values) -> Any:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _noticed_by(fault: dict[str, Any]) -> tuple[str, ...]:
    if fault.get("during") == "replace":
        return ("replacement_failed",)  # the replacement died as it started: started again
    return _NOTICED_BY.get(fault["kind"], ())


def _noticed(fault: dict[str, Any], fired: dict[str, Any], events: list[dict]) -> str | None:
    after = fired.get("at") or (fired.get("ts") if fired["type"] == "fault_injected" else 0.0)
    after = after or 0.0
    for e in events:
        if e.get("type") not in _noticed_by(fault) or e.get("ts", 0) < after:
            continue
        if e["type"] == "straggler" and fault["rank"] not in (e.get("ranks") or [e.get("rank")]):
            continue
        return f"{e['type']} after {e['ts'] - after:.1f} s" if after else e["type"]
    return None


def judge(
    sc: Scenario,
    faults: list[dict[str, Any]],
    result: dict[str, Any],
    events: list[dict[str, Any]],
    baseline_digest: str | None,
    alerts: dict[str, float] | None = None,
    alerts_error: str | None = None,
    network: list[dict[str, Any]] = (),
    durable: fencing.Audit | None = None,
    also: Sequence[Check] = (),
) -> Verdict:
    """The verdict of one chaos run of `sc` (its resolved `faults`, and the records of the
    `network` faults carried out on its cluster); `alerts_error`: why Prometheus did not
    answer when last asked, if it did not; `durable`: what the run wrote to the durable
    store (None: it writes none); `also`: checks the caller made itself (a cluster lost
    and resumed: cluster_loss.py)."""
    ex = sc.expect
    rows = fault_rows(result, events, faults) + network_rows(result, list(network), len(faults))
    checks: list[Check] = []
    status = result.get("status", "?")
    if ex.finishes:
        err = (result.get("error") or {}).get("message")
        checks.append(
            Check(
                "finishes",
                status == "succeeded",
                f"status {status}" + (f": {err}" if err and status != "succeeded" else ""),
            )
        )
    digest = result.get("model_digest")
    if ex.digest_equals_baseline:
        same = digest is not None and digest == baseline_digest
        checks.append(
            Check(
                "identical model",
                same,
                f"digest {_short(digest)} {'==' if same else '!='} baseline "
                f"{_short(baseline_digest)}",
            )
        )
    for row in rows:
        label = f"fault {row.index} ({row.kind})"
        checks.append(Check(f"{label}: injected", row.outcome == "injected", row.outcome))
        if row.outcome != "injected":
            continue
        wanted = _noticed_by(faults[row.index]) if row.index < len(faults) else ()
        if row.failures == 0 and wanted:
            checks.append(
                Check(
                    f"{label}: noticed",
                    row.noticed is not None,
                    row.noticed or f"no {' or '.join(wanted)} event followed",
                )
            )
        if row.failures and ex.max_steps_lost_per_failure is not None:
            lost = row.steps_lost
            checks.append(
                Check(
                    f"{label}: steps lost",
                    lost is not None and lost <= ex.max_steps_lost_per_failure,
                    f"{lost} (at most {ex.max_steps_lost_per_failure})",
                )
            )
        limit = ex.max_recovery_seconds.get(row.kind, ex.max_recovery_seconds.get("default"))
        if row.failures and limit is not None:
            took = row.recovered_after_s
            checks.append(
                Check(
                    f"{label}: recovery time",
                    took is not None and took <= limit,
                    f"{seconds(took)} (at most {limit:g} s)",
                )
            )
    if ex.max_failures is not None:
        n = len(result.get("failures", []))
        kinds = sorted({x["kind"] for x in result.get("failures", [])})
        checks.append(
            Check(
                "failures",
                n <= ex.max_failures,
                f"{n} (at most {ex.max_failures})" + (f": {', '.join(kinds)}" if n else ""),
            )
        )
    # Restarted from scratch: restored step 0 (or nothing) with steps to redo.
    scratch = [
        x
        for x in result.get("failures", [])
        if not x.get("restored_step") and (x.get("steps_redone") or 0) > 0
    ]
    if not ex.from_scratch_ok:
        checks.append(
            Check(
                "no restart from step 0",
                not scratch,
                "every recovery restored a committed step"
                if not scratch
                else f"{len(scratch)} failure(s) sent the job back to step 0 (no step had "
                f"copies to restore): redone {sum(x['steps_redone'] for x in scratch)} steps",
            )
        )
    checks.append(Check(fencing.CHECK, *fencing.check(durable, events)))
    checks += also
    if ex.memory_flat:
        checks.append(_memory_flat(events))
    if ex.alerts:
        if alerts is None:
            checks.append(
                Check("alerts", False, "expected alerts, but no --prometheus URL was given")
            )
        for name in ex.alerts:
            if alerts is not None:
                fired = name in alerts
                if fired:
                    detail = f"fired {alerts[name]:.0f} s after the start"
                elif alerts_error:
                    detail = f"not seen firing: {alerts_error}"
                else:
                    detail = "never fired"
                checks.append(Check(f"alert {name}", fired, detail))
    return Verdict(
        scenario=sc.name,
        passed=all(c.ok for c in checks),
        status=status,
        digest=digest,
        baseline_digest=baseline_digest,
        steps=result.get("steps_completed") or 0,
        wall_seconds=result.get("wall_seconds"),
        faults=rows,
        checks=checks,
        alerts=alerts,
        output=result.get("output"),
    )


def _memory_flat(events: list[dict[str, Any]]) -> Check:
    """The checkpoint memory after the last fault returns to its floor: the lowest reading
    of the later half is no higher than the highest of the earlier half. What a node holds
    swings with the commit lag and the copies' stride (a sawtooth, up to 2x here); a leak
    raises the floor itself, step after step."""
    fired = [e.get("at") or e["ts"] for e in events if e.get("type") == "fault_injected"]
    since = max(fired, default=0.0)
    held = [
        e["memory_bytes"]
        for e in events
        if e.get("type") == "throughput" and e["ts"] > since and e.get("memory_bytes")
    ]
    held = held[len(held) // 5 :]  # the first recovery's settling
    if len(held) < 6:
        return Check("memory flat", False, f"{len(held)} readings after the last fault: too few")
    half = len(held) // 2
    early, floor = max(held[:half]), min(held[half:])
    ok = floor <= early + (1 << 20)
    return Check(
        "memory flat",
        ok,
        f"checkpoint memory peaked at {early / 2**20:.1f} MiB, then came back to "
        f"{floor / 2**20:.1f} MiB ({len(held)} readings after the last fault)"
        if ok
        else f"checkpoint memory never came back below {floor / 2**20:.1f} MiB after "
        f"peaking at {early / 2**20:.1f} MiB ({len(held)} readings after the last fault): "
        "it grows with the steps",
    )


def _short(d: str | None) -> str:
    return d[:12] if d else "none"


def seconds(v: float | None) -> str:
    """A duration for the verdict's table and checks: "1.23 s", or "-" when unknown."""
    return "-" if v is None else f"{v:.2f} s"
