"""How many CPUs this process may use: what a worker sizes its torch thread pool by.

`os.cpu_count()` is the node's count. A container's CPU limit (a cgroup quota) and the process's
affinity can be far lower: the API computed each worker's threads from the head node's cores, so
on Kubernetes a worker pod limited to 4 CPUs ran 16 threads on a 32-core head's word, throttled.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

log = logging.getLogger("oasiskv")


def cpu_quota(cgroup_root: str | Path = "/sys/fs/cgroup") -> float | None:
    """The cgroup CPU limit in CPUs (v2 cpu.max, else v1 cfs quota / period); None: no limit."""
    root = Path(cgroup_root)
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def cpus_available(cgroup_root: str | Path = "/sys/fs/cgroup") -> int:
    """CPUs this process may run on: its affinity, capped by the cgroup's quota (rounded up: a
    limit of 2.5 CPUs runs three threads part of the time), at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cpu_quota(cgroup_root)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def threads_within_limit(asked: int, cgroup_root: str | Path = "/sys/fs/cgroup") -> int:
    """`asked` torch threads, or fewer where this process may use fewer CPUs."""
    available = cpus_available(cgroup_root)
    if asked > available:
        log.info("using %d torch threads, not %d: this process may use %d CPU(s)", available, asked, available)
        return available
    return asked
