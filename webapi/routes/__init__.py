"""HTTP routes: ``jobs`` (the /v1 jobs API), ``verify`` (/v1/verify) and ``health``
(/healthz, /readyz, /metrics)."""
