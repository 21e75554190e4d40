"""Run a function on N real gloo processes: the harness every multi-rank test uses.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, initialises a gloo
process group in each (one thread per rank, over a TCPStore the test's own process hosts on a
port the system chose), calls ``fn(rank, world_size, *args)`` and returns every rank's result. A
failing rank's traceback is raised in the test; a rank that hangs fails the test after
``timeout`` seconds instead of hanging it.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOADED = ["torch", "torch.distributed", "torch.distributed.fsdp", "zeropp", "zeropp.techniques.qwz",
             "zeropp.techniques.hpz", "zeropp.techniques.qgz", "zeropp.fsdp.unused", "zeropp.engine",
             "torchtitan.models.llama3", "torchtitan.models.qwen3", "torchtitan.config", "lightning.pytorch",
             "transformers.trainer", "transformers.models.llama.modeling_llama", "peft", "zeropp.hf"]
"""Imported once by the fork server every rank is forked from: a spawned rank would import torch
again (seconds of CPU each, four ranks a run, on two cores), and transformers' Trainer, peft,
torchtitan's models and lightning (5 s more, 3 and 4 s) in the tests that run them. A module that
is not installed is skipped by the server. The server imports them with the parent's environment;
a rank sets its own before it runs, and what the tests vary per rank (``ZEROPP_*``, torchrun's
variables) is read when called, not at import."""


def _context() -> Any:
    """Ranks forked from one server that has torch imported. Like spawned ones, they start from
    fresh modules (the server never runs a test) and carry the parent's environment of the
    moment (``_environment``), not the server's."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOADED)
    return ctx


def _environment(env: dict[str, str] | None) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, env: dict[str, str], fn: Callable,
            args: tuple, results: mp.Queue, timeout: float) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
    torch.set_num_threads(1)
    faulthandler.enable(all_threads=True)  # a rank that crashes in native code prints every thread's stack
    if hasattr(torch._C, "_set_print_stack_traces_on_fatal_signal"):
        torch._C._set_print_stack_traces_on_fatal_signal(True)  # and their C++ frames, which faulthandler cannot
    deadline = time.monotonic() + timeout
    store = None
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout))
        dist.init_process_group("gloo", rank=rank, world_size=world_size, store=store,
                                timeout=datetime.timedelta(seconds=timeout))
        result = fn(rank, world_size, *args)
        results.put((rank, True, result))
    except BaseException:  # report everything, the parent decides
        results.put((rank, False, traceback.format_exc()))
    finally:
        if store is not None:
            _leave_together(store, world_size, deadline)
        if dist.is_initialized():
            dist.destroy_process_group()


def _leave_together(store: dist.TCPStore, world_size: int, deadline: float) -> None:
    """Wait until every rank has finished its function.

    [Note: ranks leave together]
    A rank that has finished its function must not exit while a peer still needs it. gloo's
    ``new_group`` connects every pair of ranks through the store (each rank publishes its address,
    then reads each peer's), with no barrier at its end: a rank can finish connecting while a peer is
    still reading addresses. Had that rank exited then, its peer's half-made pair was closed
    ("Connection closed by peer"), and when the rank was rank 0, which hosted the store then, the
    peer's read from the store was reset ("Connection reset by peer"). A loaded machine makes the
    gap wide (reproduced: 4 ranks ending right after three ``new_group`` calls, the last rank at
    nice 19 beside a CPU hog, failed 10 runs in 20). So every rank waits, through the store, until
    all have finished their function, before it destroys its process group; and the store lives in
    the test's process, not in a rank, so no rank's exit can take it from the others. The wait ends
    at the run's deadline: a rank that hangs is the parent's to report and kill."""
    with contextlib.suppress(Exception):
        if store.add("harness/finished", 1) == world_size:
            store.set("harness/all_finished", "1")
        store.wait(["harness/all_finished"], datetime.timedelta(seconds=max(deadline - time.monotonic(), 1.0)))


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                    env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` must be a module-level function (it is pickled into the ranks' processes). ``env`` is set
    in every rank before the process group starts (e.g. ``ZEROPP_RANKS_PER_NODE``).
    """
    try:
        return _run_once(fn, world_size, args, timeout, env)
    except _Crashed as crash:  # [Note: a rank killed by a signal]
        print(f"run_distributed: {crash.args[0].splitlines()[0]}; running the ranks once more "
              "(the crashed rank's stack is in the captured stderr)", file=sys.stderr)
        return _run_once(fn, world_size, args, timeout, env)


FAILURE_GRACE_S = 5.0
"""How long the other ranks' reports are awaited after a rank fails: a rank whose peer failed
often fails too, with the transport's message ("Connection reset by peer"), and may report
first; the error that is not a broken connection is the cause ([Note: the cause first])."""

BROKEN_CONNECTION = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused")


def _failure(outcome: dict[int, tuple[bool, Any]], procs: list, world_size: int) -> AssertionError:
    """One error for a run in which ranks failed, the likely cause first.

    [Note: the cause first]
    When one rank fails inside a collective, gloo closes its connections and its peers fail with
    "Connection reset by peer"; any of them can report before the rank that caused it. So the
    parent waits ``FAILURE_GRACE_S`` for the other reports, then names every failed rank, a rank's
    own error (one that is not a broken connection) before the broken connections it caused, and
    the ranks that died without a report, with their exit codes (a signal: killed, or crashed in
    native code)."""
    failed = {r: value for r, (ok, value) in outcome.items() if not ok}
    ordered = sorted(failed, key=lambda r: (any(m in failed[r] for m in BROKEN_CONNECTION), r))
    silent = {r: procs[r].exitcode for r in range(world_size) if r not in outcome}
    summary = [f"ranks {ordered} of {world_size} failed"]
    if silent:
        summary.append("ranks without a report (exit code, None while running): "
                       + ", ".join(f"{r}: {code}" for r, code in silent.items()))
    body = "\n".join(f"--- rank {r}:\n{failed[r]}" for r in ordered)
    error = _Crashed if any(code is not None and code < 0 for code in silent.values()) else AssertionError
    return error("; ".join(summary) + "\n" + body)


class _Crashed(AssertionError):
    """A rank died by a signal (a crash in native code), not by a test's assertion or error.

    [Note: a rank killed by a signal]
    Under load, about one run in a dozen of a plain ZeRO-3 / hpZ test on 4 gloo ranks (beside two
    CPU hogs; once in a whole suite on a quiet machine, and once in context parallel's test in CI)
    lost a rank to SIGSEGV in one of gloo's native threads while the rank's Python thread waited on
    a collective's work (``overlap``'s late reduce-scatter); its peers then read "Connection reset
    by peer". faulthandler (enabled in
    every rank) shows no Python frame on the crashing thread; every rank now also prints each
    thread's C++ frames on a fatal signal, which is how the abort at exit in [Note: the backend
    lets go after the wait] (``zeropp.fsdp.comms``) was found. Such a run is started once more,
    and says so on stderr; a second crash fails the test. The cause is not found yet."""


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float,
              env: dict[str, str] | None) -> list[Any]:
    ctx = _context()
    results = ctx.Queue()
    env = _environment(env)
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, timeout=datetime.timedelta(seconds=timeout),
                          wait_for_workers=False)  # [Note: ranks leave together]
    procs = [ctx.Process(target=_worker, args=(r, world_size, store.port, env, fn, args, results, timeout),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    failed_at = None
    try:
        while len(outcome) < world_size:
            if failed_at is not None and time.monotonic() > failed_at + FAILURE_GRACE_S:
                break
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(outcome))
                dead = {r: procs[r].exitcode for r in missing if procs[r].exitcode not in (None, 0)}
                if failed_at is not None and len(dead) == len(missing):
                    break  # every rank has reported or died: nothing more to wait for
                if dead and failed_at is None:  # died before reporting (a crash, or an import that failed)
                    error = _Crashed if any(code < 0 for code in dead.values()) else AssertionError
                    raise error(f"ranks {sorted(dead)} exited with {sorted(set(dead.values()))} "
                                "before reporting a result; their stderr says why") from None
                if time.monotonic() > deadline and failed_at is None:
                    raise AssertionError(f"ranks {missing} gave no result within {timeout} s (hang?)") from None
                continue
            outcome[rank] = (ok, value)
            if not ok and failed_at is None:
                failed_at = time.monotonic()
        if failed_at is not None:
            raise _failure(outcome, procs, world_size)
    finally:
        for p in procs:  # after a failure, the survivors wait for a peer that will not come: kill them
            p.join(timeout=5 if failed_at is None else 0.1)
            if p.is_alive():
                p.kill()
        del store  # closed once every rank has exited or been killed
    return [outcome[r][1] for r in range(world_size)]


def _fake_worker(rank: int, world_size: int, env: dict[str, str], fn: Callable, args: tuple,
                 results: mp.Queue) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
        results.put((True, fn(rank, world_size, *args)))
    except BaseException:
        results.put((False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_fake_rank(fn: Callable[..., Any], world_size: int, rank: int, *args: Any, timeout: float = 120.0,
                  env: dict[str, str] | None = None) -> Any:
    """Run ``fn(rank, world_size, *args)`` as rank ``rank`` of a ``world_size``-rank job on
    PyTorch's fake process group, in one spawned process, and return its result. Collectives
    return at once with placeholder data: for layouts, process groups and allocations, never for
    numerics."""
    ctx = _context()
    results = ctx.Queue()
    env = _environment(env)
    process = ctx.Process(target=_fake_worker, args=(rank, world_size, env, fn, args, results), daemon=True)
    process.start()
    try:
        ok, value = results.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"fake rank {rank} of {world_size} gave no result within {timeout} s") from None
    finally:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
    if not ok:
        raise AssertionError(f"fake rank {rank} of {world_size} failed:\n{value}")
    return value
