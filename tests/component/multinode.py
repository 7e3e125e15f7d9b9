"""A real multi-node Ray on this machine: several raylets (ray.cluster_utils), a CPU-less
head for the driver and the supervisor, and worker nodes the tests kill or add."""

from __future__ import annotations

WORKER_NODE_CPUS = 2


class MultiNode:
    def __init__(self):
        from ray.cluster_utils import Cluster

        from stalwart.orchestrator.chaos.runner import QUIET_HEAD

        self.cluster = Cluster(
            initialize_head=True,
            connect=False,
            head_node_args={"num_cpus": 0, **QUIET_HEAD},
        )
        self.address = self.cluster.address

    @staticmethod
    def _alive(node) -> bool:
        return all(p.process.poll() is None for p in node.all_processes["raylet"])

    def ensure_worker_nodes(self, n: int, exactly: bool = False) -> None:
        """At least (or `exactly`) `n` live worker nodes, registered with the cluster; nodes
        a test killed are removed."""
        for node in list(self.cluster.worker_nodes):
            if not self._alive(node):
                self.cluster.remove_node(node, allow_graceful=False)
        while exactly and len(self.cluster.worker_nodes) > n:
            self.cluster.remove_node(next(iter(self.cluster.worker_nodes)))
        while len(self.cluster.worker_nodes) < n:
            self.cluster.add_node(num_cpus=WORKER_NODE_CPUS)
        self.cluster.wait_for_nodes()

    def shutdown(self) -> None:
        import ray

        ray.shutdown()  # a job thread left connected must not keep the head from stopping
        self.cluster.shutdown()
