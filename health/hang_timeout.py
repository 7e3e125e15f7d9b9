"""How long a rank may go without finishing a step before it is hung.

A fixed five minutes (the old default) is the largest loss after a node failure on a big
job: every hang costs the whole world five minutes of nothing. Unless the spec fixes it
(`health.hang_timeout_s`), the timeout is derived from the job's own steps, as NVIDIA's
resiliency extension derives its heartbeat timeouts from observed intervals:

- a step: `factor` x the longest step seen in the job (each generation's first step, which
  compiles, warms up and restores, left out), never under `floor_s`;
- a generation's first step, and every step until the job has seen `min_steps`:
  `startup_s` (a rendezvous, a restore from storage, a compile take their time);
- a rank waiting for its checkpoint copies to reach peer nodes (backpressure: a slow link
  slows the copies, it hangs nothing): `copies_s` before replication is called stuck;
- a rank past its step timeout whose training thread still uses its CPU (an evaluation
  every thousand steps, a long step the job has not seen yet) is busy, not hung: it gets
  up to `busy_limit_s`. A deadlock, a sleep, a blocked read use none.

Pure: the monitor feeds the longest step and the count, the detector reads the timeouts.
"""

from __future__ import annotations

from dataclasses import dataclass

from stalwart.health.observations import RankView


@dataclass(frozen=True)
class HangPolicy:
    floor_s: float = 20.0
    factor: float = 5.0
    startup_s: float = 300.0
    copies_s: float = 60.0
    busy_limit_s: float = 1800.0
    min_steps: int = 5


@dataclass(frozen=True)
class HangTimeouts:
    """The timeouts in use, and how they came about (for reasons, events and logs)."""

    step_s: float  # a step after its generation's first
    startup_s: float  # a generation's first step
    busy_limit_s: float  # a rank past step_s that still uses its CPU
    why: str
    derived: bool
    copies_s: float = 60.0  # waiting for its checkpoint copies to reach peers

    @classmethod
    def fixed(cls, seconds: float) -> HangTimeouts:
        """health.hang_timeout_s: one timeout for everything, as the spec says."""
        return cls(seconds, seconds, seconds, f"health.hang_timeout_s={seconds}", False, seconds)

    def _rule(self, r: RankView) -> tuple[float, str]:
        """The timeout that applies to `r` (derived), and the setting it comes from."""
        if r.copies_since is not None and r.collective_since is None:
            return self.copies_s, "waiting for its checkpoint copies, health.hang.copies_s"
        if not r.stepped:
            return self.startup_s, "its generation's first step, health.hang.startup_s"
        if r.busy and not r.waiting:
            return self.busy_limit_s, "busy on its CPU, health.hang.busy_limit_s"
        return self.step_s, ""

    def for_rank(self, r: RankView) -> float:
        """How long `r` may go without finishing a step."""
        return self._rule(r)[0] if self.derived else self.step_s

    def describe(self, r: RankView) -> str:
        """The timeout that applied to `r`, in words, for a hang's reason."""
        if not self.derived:
            return self.why
        seconds, setting = self._rule(r)
        if seconds == self.step_s:
            return f"hang timeout {seconds:.1f} s: {self.why}"
        return f"{setting}={seconds:g}"


def derive(policy: HangPolicy, longest_step_s: float | None, steps_seen: int) -> HangTimeouts:
    """The timeouts for a job that has seen `steps_seen` steps (its generations' first
    steps left out), the longest of them `longest_step_s`."""
    p = policy
    if longest_step_s is None or steps_seen < p.min_steps:
        return HangTimeouts(
            p.startup_s,
            p.startup_s,
            p.busy_limit_s,
            f"not derived yet ({steps_seen} of health.hang.min_steps={p.min_steps} steps "
            f"seen): health.hang.startup_s={p.startup_s:g}",
            True,
            p.copies_s,
        )
    scaled = p.factor * longest_step_s
    if scaled >= p.floor_s:
        why = f"{p.factor:g} x the longest step seen ({longest_step_s:.2f} s)"
    else:
        why = (
            f"health.hang.floor_s={p.floor_s:g} ({p.factor:g} x the longest step seen, "
            f"{longest_step_s:.2f} s, is less)"
        )
    step_s = max(p.floor_s, scaled)
    return HangTimeouts(step_s, max(p.startup_s, step_s), max(p.busy_limit_s, step_s), why, True)
