"""Each node's link as the supervisor sees it: the round trips of its report requests.

The poller (supervisor/poller.py) hands every answer's round trip here, timed from the
request to the answer's arrival (a callback on the reply, not the next poll: a poll every
report_interval_s would round every round trip up to it). The verdict is
health/slow_link.py's; this keeps the samples (written from Ray's callback thread, read
from the control loop) and the flags, so a lasting slow link is news once and its end is
news once.
"""

from __future__ import annotations

import threading
from collections import deque

from stalwart.health.slow_link import LinkConfig, LinkReport, link_scores

JUDGE_EVERY_S = 1.0  # a verdict costs nodes x span: at most one a second


class LinkWatch:
    def __init__(self, config: LinkConfig, enabled: bool = True):
        self.config = config
        self.enabled = enabled
        self._lock = threading.Lock()
        self._samples: dict[str, deque[float]] = {}
        self._since_flag: dict[str, int] = {}  # flagged node -> round trips since last flagged
        self._counts: dict[str, int] = {}  # node -> round trips ever, to count calm ones
        self.flagged: dict[str, float] = {}  # node -> when it was flagged
        self._gone: set[str] = set()  # lost nodes: a late answer of theirs is not kept
        self._judged_at = 0.0
        self.report = LinkReport()

    def round_trip(self, node: str, seconds: float) -> None:
        """One answer from `node`'s agent, `seconds` after its request (any thread)."""
        if not self.enabled:
            return
        with self._lock:
            if node in self._gone:
                return
            q = self._samples.get(node)
            if q is None:
                q = self._samples[node] = deque(maxlen=self.config.span)
            q.append(seconds)
            self._counts[node] = self._counts.get(node, 0) + 1

    def forget(self, node: str) -> None:
        """A lost node: its samples go, and so does its flag (no clearing event); an
        answer of its still on its way is not kept."""
        with self._lock:
            self._gone.add(node)
            self._samples.pop(node, None)
            self._counts.pop(node, None)
            self._since_flag.pop(node, None)
        self.flagged.pop(node, None)

    def judge(self, now: float) -> tuple[list[str], list[str], str] | None:
        """The nodes newly flagged and those cleared (a flag clears after a verdict's span
        of round trips without it: a link that hovers at the threshold is one alert), and
        the verdict's reason; None between verdicts (at most one per JUDGE_EVERY_S)."""
        if not self.enabled or now - self._judged_at < JUDGE_EVERY_S:
            return None
        self._judged_at = now
        with self._lock:
            samples = {n: list(q) for n, q in self._samples.items()}
            counts = dict(self._counts)
        report, reason = link_scores(samples, self.config)
        self.report = report
        new = [n for n in report.flagged if n not in self.flagged]
        for node in report.flagged:
            self.flagged.setdefault(node, now)
            self._since_flag[node] = counts.get(node, 0)
        cleared = [
            n
            for n in self.flagged
            if n not in report.flagged
            and counts.get(n, 0) - self._since_flag.get(n, 0) >= self.config.span
        ]
        for node in cleared:
            del self.flagged[node]
            self._since_flag.pop(node, None)
        return new, cleared, reason
