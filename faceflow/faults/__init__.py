"""Reliability under faults: drive the real stack with a mixed load while injecting faults.

``faceflow selftest faults`` (or ``bench/faults.py``) runs the matrix; see
``faceflow.faults.scenarios`` for the scenarios and ``faceflow.faults.report`` for what
each column means.
"""
