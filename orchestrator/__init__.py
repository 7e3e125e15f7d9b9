"""stalwart's control plane: the CLI, the driver, the supervisor and what runs in each process."""
