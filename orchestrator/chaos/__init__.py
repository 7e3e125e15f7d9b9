"""Chaos faults: the actions a worker carries out, and the bookkeeping the supervisor does."""
