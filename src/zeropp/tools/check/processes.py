"""Stopping what a section started: the runner stops every process under a section's setsid (the
section starts its own commands in process groups of their own, under that sid), a section stops
one command's group."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def kill_sid(sid: int) -> None:
    """SIGKILL every process whose ``os.getsid`` is ``sid`` (Linux: read from ``/proc``)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
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
