"""The outbox relay: dispatch, sync, expire, reap and notify loops.

Runs inside the webapi process by default (``start_relay``/``stop_relay``) or standalone
(``run_relay_forever`` for ``faceflow relay``); ``reconcile_once`` runs one pass of every
step. Safe with several replicas: outbox rows are claimed with leases.
"""
