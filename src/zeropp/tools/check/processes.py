"""Stopping what a section started: the runner stops a section's whole session (the section
starts its own commands in process groups of their own, inside that session), a section stops
one command's group."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def kill_session(session_id: int) -> None:
    """SIGKILL every process of the session ``session_id`` (Linux: read from ``/proc``)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == session_id:
                    os.kill(int(entry.name), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue


def run_group(command: Sequence[str], timeout_s: float, **popen: Any) -> int | None:
    """Run ``command`` in a process group of its own; kill the group after ``timeout_s``. Its
    exit status, or None when it was killed."""
    process = subprocess.Popen(list(command), preexec_fn=os.setpgrp, **popen)
    try:
        return process.wait(timeout=max(0.0, timeout_s))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return None
