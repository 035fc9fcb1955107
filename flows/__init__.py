"""Prefect flows and the contract the webapi sends them.

Two layers: the run contract (``flows.params``, ``flows.binding``), which the webapi
imports, and the flows; the GPU flows (``fuse-faces``, ``fuse-batch``, ``fuse-video``)
import only tasks and blocks, the control-plane flows (``reconcile``, ``retention``) run
the webapi's passes and so sit above it.
"""
