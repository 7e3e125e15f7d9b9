"""The per-job supervisor: the actor (its loop and state machine) and the collaborators it
drives, each owning one kind of state: the worker pool, preflight, the generation, detection,
checkpoints, recovery, elastic resizing and the ledger."""
