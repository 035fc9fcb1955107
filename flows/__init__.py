"""Prefect flows: ``fuse-faces`` (one job) and ``reconcile`` (scheduled safety net)."""
