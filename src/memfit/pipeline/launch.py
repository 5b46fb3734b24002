"""Run a function in K local processes, one rank each, and never hang when one of them fails.

A pipeline rank that raises or dies leaves its neighbours blocked in a receive that no one will
send; gloo notices a closed connection only sometimes, and a rank killed while its peers compute
leaves them waiting for the collective timeout (30 minutes by default). ``torchrun`` watches its
workers for this; for local runs (tests, ``memfit pipeline --run``) this module does the same
with ``torch.multiprocessing``: the parent polls its children, and when one reports an
exception, exits or is killed, it ends all the others and raises :class:`RankError` naming the
first rank that failed (not the neighbours that failed after it with "connection closed"). A
wall-clock ``timeout`` bounds the whole run.

Results travel back pickled to bytes: a tensor sent through a multiprocessing queue is shared
through a file descriptor that dies with the child, and children end as soon as they report.
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankError", "free_port", "launch"]

T = TypeVar("T")

#: seconds to let other ranks report after the first failure, so the root cause can be picked
_GRACE = 1.5
#: seconds ranks that all reported get to exit on their own before they are ended
_EXIT = 30.0
_POLL = 0.05


class RankError(RuntimeError):
    """A rank of a local launch failed; ``rank`` is the first that did, ``reason`` why."""

    def __init__(self, rank: int, world: int, reason: str) -> None:
        super().__init__(f"pipeline rank {rank} of {world} failed: {reason}")
        self.rank = rank
        self.reason = reason


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now (for the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _dumps(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


class _Ended(BaseException):
    """The launcher ended this rank (SIGTERM): leave through the exit handlers, unreported."""


def _ended(signum: int, frame: Any) -> None:
    raise _Ended


def _child(
    rank: int,
    world: int,
    port: int,
    backend: str,
    timeout: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    # the ranks share the machine's cores, as torchrun's workers do (it sets OMP_NUM_THREADS=1):
    # with torch's default, one thread per core in every rank, K ranks' intra-op threads spin
    # against each other (a 64-wide Linear took 8 ms instead of 40 us, 4 ranks on 2 cores)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # ended while running Python (not blocked in a receive), a rank still runs its exit handlers
    # (NOTE [Ranks that reported exit on their own])
    signal.signal(signal.SIGTERM, _ended)
    try:
        _rank(rank, world, backend, timeout, fn, args, results)
    except _Ended:
        raise SystemExit(128 + signal.SIGTERM) from None


def _rank(
    rank: int,
    world: int,
    backend: str,
    timeout: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout)
        )
        value = fn(rank, *args)
        results.put((rank, "ok", _dumps(value)))
    except _Ended:
        raise
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        results.put((rank, "error", traceback.format_exc()))
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the result is in; a peer gone first is no failure
        pass


def _is_echo(reason: str) -> bool:
    """A failure caused by another rank's (a peer closing the connection)."""
    text = reason.lower()
    return any(
        s in text
        for s in ("connection closed by peer", "connection reset", "broken pipe", "socket closed")
    )


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code} without reporting"


def launch(
    fn: Callable[..., T],
    nprocs: int,
    *,
    args: tuple[Any, ...] = (),
    timeout: float = 60.0,
    backend: str = "gloo",
) -> list[T]:
    """Run ``fn(rank, *args)`` in ``nprocs`` processes in one process group; results by rank.

    Each process initialises ``torch.distributed`` (``backend``, rendezvous on a free local
    port, ``timeout`` for its collectives) before calling ``fn``, which must be importable
    (spawned processes import it by name) and return something picklable. Raises
    :class:`RankError` naming the first rank that failed, after ending every other process,
    and when the whole run takes longer than ``timeout`` seconds.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(rank, nprocs, port, backend, timeout, fn, args, results),
            daemon=True,
        )
        for rank in range(nprocs)
    ]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    failures: dict[int, str] = {}
    first_failure: float | None = None
    deadline = time.monotonic() + timeout
    try:
        while len(done) < nprocs:
            try:
                rank, kind, payload = results.get(timeout=_POLL)
                if kind == "ok":
                    done[rank] = _loads(payload)
                else:
                    failures.setdefault(rank, payload)
            except queue.Empty:
                pass
            for rank, p in enumerate(procs):
                if rank not in done and rank not in failures and not p.is_alive():
                    time.sleep(_POLL)  # a report sent just before exiting may still be queued
                    if results.empty():
                        failures[rank] = _exit_reason(p.exitcode)
            now = time.monotonic()
            if failures:
                first_failure = first_failure or now
                if now - first_failure >= _GRACE or len(done) + len(failures) == nprocs:
                    break
            if now > deadline:
                running = [r for r in range(nprocs) if r not in done and r not in failures]
                raise RankError(
                    running[0] if running else 0,
                    nprocs,
                    f"timed out after {timeout:g} s; ranks {running} had not finished",
                )
    finally:
        # NOTE [Ranks that reported exit on their own]
        # A rank reports before it leaves its process group and runs its exit handlers, which
        # release what it made: a multiprocessing lock is a named semaphore, unlinked at exit
        # (``torch.fx``'s interpreter makes one in every rank, for tqdm). Ended by a signal
        # there, a rank leaves it to the resource tracker, which unlinks it and warns "There
        # appear to be N leaked semaphore objects" when the launcher exits: every run did, when
        # ranks were ended as soon as the last result came. Ranks still running after a failure
        # or the timeout are ended at once; one running Python then leaves by its exit handlers
        # too (``_ended``), one blocked in a receive is killed after 2 s and leaves its own.
        if len(done) == nprocs:
            stop = time.monotonic() + _EXIT
            for p in procs:
                p.join(timeout=max(0.0, stop - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    if failures:
        causes = [r for r in sorted(failures) if not _is_echo(failures[r])]
        rank = causes[0] if causes else min(failures)
        raise RankError(rank, nprocs, failures[rank])
    return [done[r] for r in range(nprocs)]
