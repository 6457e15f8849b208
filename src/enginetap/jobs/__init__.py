"""End-to-end jobs that combine an engine, traffic and a capability (capture, tap)."""
