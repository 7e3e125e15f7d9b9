"""What runs in a rank's process: the worker actor, the train context, the recoverable group,
the preflight probes and resolving the entrypoint."""
