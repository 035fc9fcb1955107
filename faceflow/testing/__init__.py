"""Support for FaceFlow's tests and benchmarks: one place for what both need.

``prefect`` (a Prefect server in subprocesses and a REST client for it), ``net`` (free
ports, waiting for an HTTP endpoint), ``wait`` (polling a condition), ``procstat`` (CPU and
memory figures from /proc), ``databases`` (throw-away PostgreSQL databases and job stores),
``inputs`` (inputs stored as the webapi stores them), ``bodies`` (hostile request bodies),
``shaped`` (GPU-shaped stand-ins for compute functions), ``jobs`` (users, images, request
bodies and jobs in a given state in a job store) and ``relay`` (a relay's surroundings: a
Prefect server with stand-in flows, a webhook receiver, a slow-body tarpit).

The service never imports this package: tests, ``bench/`` and the fault suite
(``faceflow.faults``) do. Importing it, or any module of it, imports neither torch nor
Prefect (the webapi's tests rely on that); what needs them imports them when called.
"""
