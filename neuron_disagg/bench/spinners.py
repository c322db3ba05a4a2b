"""Background threads that burn a core while their instance is idle, found by measuring and then
reniced, so that on this 2-core machine they do not take the core their own model computes on; and
what each instance costs its core while it has nothing to do (``idle_cpu_percent``).

Why: the benchmark gives each instance one core for all of its processes. vLLM's NIXL connectors
start NIXL's progress thread, which polls without pause; on a real host it has a core of its own,
here it would halve its instance's compute. Renicing it (nice 19) keeps it running whenever the core
is otherwise free. The rule is the same for every mode and is decided by measurement, not by name:
a thread other than its process's main thread that used more than ``threshold`` of a core while
the instance served nothing. Our connector's threads sleep when idle, so none of ours qualifies.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")


def _group_threads(pgid: int) -> list[tuple[int, int]]:
    """(pid, tid) of every thread of every process in process group ``pgid``."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:  # after the command: state, ppid, pgrp
                continue
            out += [(int(proc.name), int(task.name)) for task in (proc / "task").iterdir()]
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return out


def _cpu_seconds(pid: int, tid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime
    except (OSError, IndexError, ValueError):
        return 0.0


def renice_idle_spinners(pgid: int, window_s: float = 2.0, threshold: float = 0.5) -> list[int]:
    """Measure the group's threads over ``window_s`` while idle; renice the spinning ones. Returns
    their thread ids."""
    threads = [t for t in _group_threads(pgid) if t[0] != t[1]]  # a process's main thread is its pid
    before = {t: _cpu_seconds(*t) for t in threads}
    time.sleep(window_s)
    spinners = [t for t in threads if _cpu_seconds(*t) - before[t] > threshold * window_s]
    for _, tid in spinners:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 19)  # on Linux a thread id renices that thread only
        except OSError:
            pass
    return [tid for _, tid in spinners]


def idle_cpu_percent(pgids: dict[str, int], window_s: float) -> dict[str, float]:
    """Per name, the percent of one core its process group (every process and thread of an
    instance) used over ``window_s``, measured together while nothing is sent to any of them."""
    def used(pgid: int) -> float:
        return sum(_cpu_seconds(*t) for t in _group_threads(pgid))

    before = {name: used(pgid) for name, pgid in pgids.items()}
    time.sleep(window_s)
    return {name: round(100 * (used(pgid) - before[name]) / window_s, 2) for name, pgid in pgids.items()}
