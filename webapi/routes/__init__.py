"""HTTP routes: ``jobs`` (the /v1 API) and ``health`` (/healthz, /readyz, /metrics)."""
