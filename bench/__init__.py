"""Benchmarks: scripts run with ``python -m bench.<name>``, never timed tests."""
