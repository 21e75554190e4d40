"""A pytest plugin that writes each test's outcome as it ends, one JSON line per event, to the
file ``ZEROPP_CHECK_PYTEST_LOG`` names::

    ZEROPP_CHECK_PYTEST_LOG=log.jsonl python -m pytest -p zeropp.tools.check.pytest_log tests/...

A run stopped by its time limit keeps every outcome it reached, and the test it was in.
"""

from __future__ import annotations

import json
import os
from typing import Any

LOG_ENV = "ZEROPP_CHECK_PYTEST_LOG"


def _write(event: dict[str, Any]) -> None:
    with open(os.environ[LOG_ENV], "a") as log:
        log.write(json.dumps(event) + "\n")


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _write({"nodeid": nodeid, "event": "start"})


def pytest_runtest_logreport(report: Any) -> None:
    """A test's outcome: its call's; its set-up's where that skipped or failed (the call never
    ran); "error" for a set-up or teardown that failed."""
    if report.when == "call" or (report.when == "setup" and not report.passed) or (
            report.when == "teardown" and report.failed):
        outcome = "error" if report.when != "call" and report.failed else report.outcome
        event = {"nodeid": report.nodeid, "event": "outcome", "outcome": outcome, "duration_s": report.duration}
        if report.skipped and isinstance(report.longrepr, tuple):
            event["reason"] = report.longrepr[2].removeprefix("Skipped: ")
        elif report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            event["reason"] = (crash.message if crash is not None else str(report.longrepr))[-1500:]
        _write(event)
