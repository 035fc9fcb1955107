"""The face pipeline: detect → align → fuse → postprocess.

This package's ``__init__`` imports nothing heavy: ``tasks.errors`` and ``tasks.options``
are safe to import from the webapi (no torch, no pipeline).
"""
