"""Benchmark runs in parallel processes on one machine: compile together, time one at a time.

Why: time on a lent GPU is short and a frontier run spends most of it compiling (Inductor, the
CPU's work), so runs of several models in parallel processes finish in about the longest one's
time instead of the sum. Their timed steps must not overlap anything else, though: a GPU step of
a few milliseconds is as much CPU launch work as GPU work, and a process compiling beside it
slows it. So each run holds a *warming* marker while it compiles (any process may hold one: a
shell can create one for a test run it starts beside), and times only once no live process holds
one, under an exclusive ``flock`` that the runs take in turn. A marker whose process has died is
removed by whoever finds it, so a run killed mid-compile never blocks the others.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["TimingLock", "live_warming_pids"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    try:  # an exited child its parent has not reaped yet (a zombie) still takes signals
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def live_warming_pids(lock: Path) -> list[int]:
    """Processes still warming up against ``lock``; stale markers (dead processes) are removed."""
    live = []
    for marker in lock.parent.glob(f"{lock.name}.warming.*"):
        try:
            pid = int(marker.name.rsplit(".", 1)[1])
        except ValueError:
            continue
        if _alive(pid):
            live.append(pid)
        else:
            marker.unlink(missing_ok=True)
    return sorted(live)


class TimingLock:
    """This process's place among runs sharing ``path``: warming from construction on."""

    def __init__(self, path: Path, poll_s: float = 0.5) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch(exist_ok=True)
        self.poll_s = poll_s
        self.marker = self.path.with_name(f"{self.path.name}.warming.{os.getpid()}")
        self.marker.touch()

    def marker_pid(self) -> int:
        """The process id this run's warming marker is named for."""
        return int(self.marker.name.rsplit(".", 1)[1])

    def done_warming(self) -> None:
        """This process compiles nothing more; the others may time once they are done too."""
        self.marker.unlink(missing_ok=True)

    @contextmanager
    def exclusive(self) -> Iterator[float]:
        """Wait until no process is warming up, then hold the lock; yields the seconds waited."""
        self.done_warming()
        start = time.perf_counter()
        while live_warming_pids(self.path):
            time.sleep(self.poll_s)
        with open(self.path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield time.perf_counter() - start
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
