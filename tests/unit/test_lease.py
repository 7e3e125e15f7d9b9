"""orchestrator/supervisor/lease.py: agents' leases are renewed while the loop is busy."""

from __future__ import annotations

import threading
import time

from stalwart.orchestrator.supervisor.lease import LeaseKeeper


class _Agent:
    def __init__(self):
        self.pings = threading.Semaphore(0)
        self.ping = self  # agent.ping.remote()

    def remote(self):
        self.pings.release()


class _Gone:
    class ping:
        @staticmethod
        def remote():
            raise RuntimeError("actor gone")


def test_every_agent_is_pinged_each_interval_and_a_gone_one_is_skipped():
    agents = [_Agent(), _Gone(), _Agent()]
    keeper = LeaseKeeper(lambda: agents, every_s=0.01)
    keeper.start()
    try:
        for agent in (agents[0], agents[2]):
            for _ in range(3):
                assert agent.pings.acquire(timeout=10)
    finally:
        keeper.stop()
    assert keeper.renewals >= 3
    done = keeper.renewals
    deadline = time.monotonic() + 5
    while keeper._thread.is_alive() and time.monotonic() < deadline:
        keeper._thread.join(0.1)
    assert not keeper._thread.is_alive() and keeper.renewals <= done + 1
