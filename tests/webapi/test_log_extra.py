"""Regression (found by the fault suite): a record logged with ``extra={"job_id": ...}``,
as every relay step logs, must not raise because the correlation ids are stamped too."""

from __future__ import annotations

import json
import logging

import pytest

from webapi.logs import JsonFormatter, log_context
from webapi.relay import dispatch


def test_extra_job_id_is_accepted_and_wins_over_the_context(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    log = logging.getLogger("webapi.test.extra")
    log.info("dispatched", extra={"job_id": "job-extra", "attempt": 3})
    with log_context(job="job-context", attempt_no=1):
        log.warning("deferred", extra={"job_id": "job-extra-2", "delay_s": 1.5})
        log.info("plain")
    lines = [json.loads(JsonFormatter().format(record)) for record in caplog.records]
    assert [(line["msg"], line.get("job_id"), line.get("attempt")) for line in lines] == [
        ("dispatched", "job-extra", 3),
        ("deferred", "job-extra-2", 1),
        ("plain", "job-context", 1),
    ]


def test_the_relay_loggers_take_their_extras(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    dispatch.log.info("dispatched", extra={"job_id": "j", "attempt": 1})
    dispatch.log.warning("dispatch deferred: %s", "x", extra={"job_id": "j", "delay_s": 0.5})
    assert [r.getMessage() for r in caplog.records] == ["dispatched", "dispatch deferred: x"]
