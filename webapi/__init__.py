"""FaceFlow web API: FastAPI + SQLModel job store, REST routes, outbox relay, webhooks.

Never imports torch, the pipeline or prefect: the relay talks to Prefect over REST.
"""
