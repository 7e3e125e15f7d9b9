"""Checkpoints: snapshots, the in-memory shard store, the commit protocol. Never imports the
orchestrator."""
