"""What runs in a node agent: the node's shard stores' host, heartbeats, replication to peers."""
