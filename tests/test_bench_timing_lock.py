"""memfit.bench.timing_lock: parallel runs time one at a time, and only once none is compiling."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from memfit.bench.timing_lock import TimingLock, live_warming_pids


def test_exclusive_waits_for_a_warming_process_and_not_for_a_dead_one(tmp_path: Path) -> None:
    lock_path = tmp_path / "timing.lock"
    me = TimingLock(lock_path, poll_s=0.01)
    warming = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    marker = lock_path.with_name(f"{lock_path.name}.warming.{warming.pid}")
    marker.touch()  # as a shell does for a run it starts beside the benchmark
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    stale = lock_path.with_name(f"{lock_path.name}.warming.{int(dead.stdout)}")
    stale.touch()
    assert live_warming_pids(lock_path) == sorted([warming.pid, me.marker_pid()])
    assert not stale.exists()  # a dead process's marker is removed, not waited for
    with me.exclusive():
        assert warming.poll() is not None  # timing began only after the warming process ended
    assert not me.marker.exists()


def test_two_runs_never_time_at_once(tmp_path: Path) -> None:
    lock_path = tmp_path / "timing.lock"
    spans: list[tuple[float, float]] = []

    def run(lock: TimingLock) -> None:
        with lock.exclusive():
            start = time.perf_counter()
            time.sleep(0.1)
            spans.append((start, time.perf_counter()))

    # flock locks belong to open files, so two TimingLocks in one process exclude each other too
    locks = [TimingLock(lock_path, poll_s=0.01) for _ in range(2)]
    threads = [threading.Thread(target=run, args=(lock,)) for lock in locks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (a0, a1), (b0, b1) = sorted(spans)
    assert a1 <= b0
