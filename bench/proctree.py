"""The process tree of a `fedapps run` as the benchmarks see it: which role a process plays, and its CPU seconds.

Shared by bench/startup.py (the run's total CPU), bench/round_overhead.py (CPU by role during the measured rounds)
and bench/scale.py (peak memory by role). Linux /proc; elsewhere nothing is read.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

# (substring of the command line, role), first match wins
ROLES = (
    ("ClientAppActor", "worker"),  # Ray's actor processes serving the ClientApp
    ("flwr-simulation", "server"),  # the ServerApp and the Ray driver (Flower's simulation engine, its message sweep)
    ("fedapps_tools.cli run", "cli"),
    ("flower-superlink", "superlink"),
    ("flower-superexec", "superlink"),  # SuperExec: the SuperLink's side that launches flwr-simulation
    ("ray", "ray"),  # raylet, gcs_server, dashboard and log monitors, Ray's idle workers
)


def role_of(cmdline: str) -> str:
    """The role of a process of the run, from its command line ("other" when none matches)."""
    for needle, role in ROLES:
        if needle in cmdline:
            return role
    return "other"


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class CpuSampler:
    """CPU seconds of a process and every process it starts, read from /proc every ``interval`` seconds while it runs.

    A process counts with the last value seen, so the final fraction of a second of each process may be missed.
    ``timeline`` keeps, per sample, (time, ``marker()``, CPU seconds so far by role), for the CPU of a window of the
    run (:func:`cpu_between`); ``marker`` is any cheap progress reading (e.g. the rows of rounds.csv). (The kernel's
    RUSAGE_CHILDREN, with this process as the subreaper of the detached ones, counted ~11 s less than this of ~60 s
    in a test here: some process on the way discards its children's.)"""

    def __init__(self, root: int, interval: float = 0.25, marker: Callable[[], int] | None = None) -> None:
        self.root, self.interval, self.marker = root, interval, marker
        self.seen: dict[tuple[int, int], float] = {}  # (pid, start time) -> CPU seconds last seen
        self.roles: dict[tuple[int, int], str] = {}
        self.timeline: list[tuple[float, int, dict[str, float]]] = []
        self._stop = threading.Event()
        self._ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _stat(self, pid: int) -> tuple[int, int, float] | None:
        try:
            raw = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        f = raw[raw.rindex(")") + 2 :].split()
        return int(f[1]), int(f[19]), (int(f[11]) + int(f[12])) / self._ticks  # parent, start time, CPU seconds

    def _run(self) -> None:
        known: set[tuple[int, int]] = set()  # (pid, start time): a recycled pid is another process
        while not self._stop.is_set():
            stats = {}
            for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
                if name.isdigit() and (st := self._stat(int(name))) is not None:
                    stats[int(name)] = st
            if not known and self.root in stats:
                known.add((self.root, stats[self.root][1]))
            alive = {pid for pid, (_, start, _) in stats.items() if (pid, start) in known}
            grew = True
            while grew:  # a child of a process of the run is one too (also when its parent is new in this sample)
                grew = False
                for pid, (parent, start, _) in stats.items():
                    if parent in alive and pid not in alive:
                        known.add((pid, start))
                        alive.add(pid)
                        grew = True
            for pid in alive:
                key = (pid, stats[pid][1])
                self.seen[key] = stats[pid][2]
                role = role_of(cmdline(pid))  # read every time: a Ray worker process becomes a ClientAppActor
                if role != "other" or key not in self.roles:  # (an exiting process's command line reads empty)
                    self.roles[key] = role
            self.timeline.append((time.time(), self.marker() if self.marker else 0, self.by_role()))
            self._stop.wait(self.interval)

    def by_role(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, seconds in list(self.seen.items()):
            role = self.roles.get(key, "other")
            out[role] = out.get(role, 0.0) + seconds
        return out

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(timeout=5)
        return sum(self.seen.values())


def cpu_between(
    timeline: list[tuple[float, int, dict[str, float]]], start_mark: int, end_mark: int
) -> tuple[float, dict[str, float]]:
    """The wall seconds and the CPU seconds by role between the first samples whose marker reached ``start_mark``
    and ``end_mark`` (to within one sampling interval)."""
    first = next(s for s in timeline if s[1] >= start_mark)
    last = next(s for s in timeline if s[1] >= end_mark)
    roles = set(first[2]) | set(last[2])
    return last[0] - first[0], {r: last[2].get(r, 0.0) - first[2].get(r, 0.0) for r in sorted(roles)}
