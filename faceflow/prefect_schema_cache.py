"""A Prefect server that checks each JSON schema against the meta-schema once, not per request.

Prefect 3.9's server validates every flow run created from a deployment against schemas: the
run's job variables against its work pool's base job template (always) and its parameters
against the deployment's parameter schema (when enforced). Each check first validates the
*schema* against JSON Schema's 2020-12 meta-schema (``jsonschema.validate`` calls
``check_schema``; the pool check also calls ``is_valid_schema``), although the schema is the
same on every run. That meta-check was the largest part of a run's creation: on this
machine's stack (PostgreSQL, a ``faceflow-gpu`` pool) a run the relay creates cost the
server 90 ms of CPU with it and 51 ms without; one whose parameters are checked too, 132
and 55 ms (``bench/run_create.py``).

``install`` memoizes Prefect's meta-check: a schema that passed once is not checked again
(keyed by its canonical JSON, with the validator's own format checker or none); a schema
that fails is checked, and
refused, every time; at most ``MAX_SCHEMAS`` are remembered. What the server accepts and
refuses is unchanged: the check is a pure function of the schema. The FaceFlow stack starts
its Prefect server and services through ``faceflow.prefect_main``, which installs it in
every server process; a Prefect server run by anyone else (Prefect Cloud, a server of the
operator's) is unaffected and pays the check. ``FACEFLOW_PREFECT_SCHEMA_CACHE=false``
turns it off.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

ENV = "FACEFLOW_PREFECT_SCHEMA_CACHE"
#: Schemas remembered as valid (deployments' parameter schemas, pools' variable schemas).
MAX_SCHEMAS = 512
_UNSET = object()


class SchemaCheckCache:
    """The schemas a validator class's ``check_schema`` already accepted."""

    def __init__(self, check: Any, limit: int = MAX_SCHEMAS) -> None:
        self.check = check  # the unwrapped classmethod's function
        self.limit = limit
        self.valid: set[tuple[bool, str]] = set()
        self.checks = 0  # meta-schema checks actually run (tests, diagnostics)
        self._lock = threading.Lock()

    def __call__(self, cls: Any, schema: Any, format_checker: Any = _UNSET) -> None:
        key: tuple[bool, str] | None = None
        if format_checker is _UNSET or format_checker is getattr(cls, "FORMAT_CHECKER", None):
            try:
                key = (format_checker is _UNSET, json.dumps(schema, sort_keys=True))
            except (TypeError, ValueError):  # not plain JSON: checked every time
                key = None
        if key is not None and key in self.valid:
            return
        with self._lock:
            self.checks += 1
        if format_checker is _UNSET:
            self.check(cls, schema)
        else:
            self.check(cls, schema, format_checker=format_checker)
        if key is not None:
            with self._lock:
                if len(self.valid) >= self.limit:
                    self.valid.clear()
                self.valid.add(key)


def install(environ: Mapping[str, str] | None = None) -> SchemaCheckCache | None:
    """Memoize the meta-schema check of Prefect's schema validator in this process (once;
    again returns the installed cache). None when switched off (``ENV`` = ``false``) or when
    this Prefect release has no such validator (its own behaviour then, logged)."""
    environ = os.environ if environ is None else environ
    if environ.get(ENV, "true").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        from prefect.utilities.schema_tools import validation

        validator = validation._VALIDATOR
        current = validator.__dict__["check_schema"]
    except (ImportError, AttributeError, KeyError) as exc:
        log.warning("Prefect's schema checks are not cached (%s: %s)", type(exc).__name__, exc)
        return None
    if isinstance(current, classmethod) and isinstance(current.__func__, SchemaCheckCache):
        return current.__func__
    if not isinstance(current, classmethod):
        log.warning("Prefect's schema checks are not cached: check_schema is no classmethod")
        return None
    cache = SchemaCheckCache(current.__func__)
    validator.check_schema = classmethod(cache)
    return cache
