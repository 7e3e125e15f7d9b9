"""Health: observations in, decisions out. Never imports the orchestrator."""
