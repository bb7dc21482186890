"""Fault drills under load: overload and balance across executors, Redis restarted, an executor killed, and the
fuzz target's bad requests."""
