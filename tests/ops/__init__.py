"""Operability through the front door: deploy files, metrics, logs, shutdown, readiness."""
