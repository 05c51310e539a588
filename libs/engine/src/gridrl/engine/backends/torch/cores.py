"""A decoding process that shares its cores: as many intra-op threads as other processes leave
cores free, re-decided while it decodes.

Why: torch's OpenMP team (and the fused kernels that run on it) splits every product between
its threads and waits for the last one at the end of each parallel region, ~150 regions a
decode step. When another process keeps one of a thread's cores busy, that thread gets a
fraction of its core and every region waits for it: on a 2-core AVX2 EPYC under a load
average of ~8, the kernel race's products took 54 ms with 2 threads against 1.2 ms with one
(docs/benchmarks.md, section 1). With one thread fewer than the cores the others keep busy,
the team never waits on a thread that is not running.

How: :func:`others_busy_cores` reads how much CPU the other processes took on this process's
cores between two readings (``/proc/stat`` busy time on the allowed CPUs, steal included, minus
this process's own CPU time); :func:`threads_for` turns that into a thread count;
:class:`ThreadGovernor` takes the readings only while the process decodes (a window that spans
idle time would count a trainer that runs while the node waits for work, and then starve the
node when the trainer waits for it) and calls ``torch.set_num_threads`` on the decoding thread
when the count changes. Pure functions apart from the reading, so the policy is tested with
numbers.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: USER_HZ: /proc/stat counts in these ticks per second on every Linux architecture
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class CpuTimes:
    """One reading.

    Attributes:
        wall_s: a monotonic clock, seconds.
        busy_s: CPU-seconds the allowed cores were busy (user, nice, system, irq, softirq,
            steal), every process counted.
        own_s: CPU-seconds of this process (all its threads).
    """

    wall_s: float
    busy_s: float
    own_s: float


def allowed_cores() -> list[int]:
    """The CPUs this process may run on (its affinity mask; all of them where it has none)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def read_cpu_times(cores: list[int] | None = None, stat: Path = Path("/proc/stat")
                   ) -> CpuTimes | None:
    """A reading of ``cores`` (default: :func:`allowed_cores`); None where ``/proc/stat`` cannot
    be read (not Linux)."""
    wanted = {f"cpu{c}" for c in (allowed_cores() if cores is None else cores)}
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        fields = line.split()
        if fields and fields[0] in wanted:
            # user nice system idle iowait irq softirq steal ...
            ticks = [int(v) for v in fields[1:9]]
            busy += ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6] + ticks[7]
    return CpuTimes(time.monotonic(), busy / _TICKS, time.process_time())


def others_busy_cores(before: CpuTimes, after: CpuTimes) -> float:
    """Cores' worth of CPU other processes (and the hypervisor's steal) took between two
    readings: (busy CPU-seconds - this process's CPU-seconds) / wall seconds, at least 0."""
    wall = after.wall_s - before.wall_s
    if wall <= 0:
        return 0.0
    return max(0.0, ((after.busy_s - before.busy_s) - (after.own_s - before.own_s)) / wall)


def threads_for(cores: int, others: float, limit: int = 0) -> int:
    """Threads for a process on ``cores`` cores while others keep ``others`` cores' worth busy:
    the cores left, rounded to the nearest whole core (a core half taken by another process
    is still worth a thread), at least 1, at most ``limit`` (0: no limit but ``cores``).

    While the process runs ``t`` threads, a competing process that wants a core gets only its
    fair share of the oversubscribed ones (2 threads beside one busy loop on 2 cores: the loop
    reads as ~0.67 cores busy): cores - 0.67 = 1.33 still rounds to 1, and at 1 thread the loop
    reads as a whole core, so the decision is stable either way."""
    free = cores - others
    threads = max(1, min(cores, int(free + 0.5)))
    return min(threads, limit) if limit > 0 else threads


class ThreadGovernor:
    """Keeps the calling (decoding) thread's torch intra-op threads at :func:`threads_for` the
    load others put on its cores. Call :meth:`begin` when a batch starts decoding and
    :meth:`step` after each decode step, from the thread that decodes (OpenMP's team size is
    that thread's setting). Not thread-safe.

    Args:
        limit: most threads (0: one per allowed core).
        window_s: seconds of decoding a decision looks at.
        on_change: called with (old, new) thread counts after each change (the node re-runs
            the kernel race there).
        read: a reading (tests pass their own).
        set_threads: applies a thread count (default ``torch.set_num_threads``).
    """

    def __init__(self, limit: int = 0, window_s: float = 0.5,
                 on_change: Callable[[int, int], None] | None = None,
                 read: Callable[[], CpuTimes | None] | None = None,
                 set_threads: Callable[[int], None] | None = None,
                 cores: int | None = None) -> None:
        self.cores = cores or len(allowed_cores())
        self.limit = limit
        self.window_s = window_s
        self._on_change = on_change
        self._read = read or read_cpu_times
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self._set = set_threads
        self.threads = threads_for(self.cores, 0.0, limit)
        self.others = 0.0  # the last window's reading
        self._start: CpuTimes | None = None
        self._set(self.threads)

    def begin(self) -> None:
        """A batch starts decoding: a new window (the time since the last batch is not
        looked at)."""
        self._start = self._read()

    def step(self) -> int:
        """After a decode step: once the window spans ``window_s`` of decoding, decide from it
        and start the next one. Returns the thread count in force."""
        start = self._start
        if start is None:
            return self.threads
        now = self._read()
        if now is None or now.wall_s - start.wall_s < self.window_s:
            return self.threads
        self._start = now
        self.others = others_busy_cores(start, now)
        wanted = threads_for(self.cores, self.others, self.limit)
        if wanted != self.threads:
            old, self.threads = self.threads, wanted
            self._set(wanted)
            log.info("other processes keep %.2f of %d cores busy: %d -> %d threads",
                     self.others, self.cores, old, wanted)
            if self._on_change is not None:
                self._on_change(old, wanted)
        return self.threads
