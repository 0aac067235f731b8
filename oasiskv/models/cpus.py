"""How many CPUs this process may use: what a worker sizes its torch thread pool by.

`os.cpu_count()` is the node's count. A container's CPU limit (a cgroup quota) and the process's
affinity can be far lower: the API computed each worker's threads from the head node's cores, so
on Kubernetes a worker pod limited to 4 CPUs ran 16 threads on a 32-core head's word, throttled;
and a head with fewer cores than the workers' pods had each of them run one thread.
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


def threads_for_share(shared_by: int, cgroup_root: str | Path = "/sys/fs/cgroup") -> int:
    """Torch threads for one of `shared_by` workers on this machine (a pod): its CPUs split
    evenly, at least 1."""
    if shared_by < 1:
        raise ValueError(f"shared_by must be at least 1, got {shared_by}")
    return max(1, cpus_available(cgroup_root) // shared_by)


def ray_node_resource(name: str) -> float:
    """How much of the custom resource `name` the Ray node this actor runs on offers in all (0
    when it offers none). Ray is imported only here: a worker placed by role resources asks it."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return float(node.get("Resources", {}).get(name, 0.0))
    return 0.0


def worker_threads(threads: int | None, role_resource: str | None) -> int | None:
    """A worker's torch threads: `threads` as asked (capped by its CPUs); or, when Ray placed it
    by `role_resource`, its node's CPUs split among as many workers as the node offers units of
    that resource; None leaves torch's default."""
    if threads:
        return threads_within_limit(threads)
    if role_resource:
        units = int(ray_node_resource(role_resource))
        chosen = threads_for_share(max(1, units))
        log.info("using %d torch threads: %d CPU(s) on this node shared by %d %s unit(s)", chosen,
                 cpus_available(), max(1, units), role_resource)
        return chosen
    return None
