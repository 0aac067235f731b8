"""The CPUs a worker may use: the cgroup quota a container's CPU limit sets caps the threads the
API asked for, and a worker placed by its role resource splits its own node's CPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from oasiskv.models.cpus import cpu_quota, cpus_available, threads_for_share, threads_within_limit


def _cgroup_v2(root, text):
    (root / "cpu.max").write_text(text)
    return root


def test_a_v2_quota_is_read_in_cpus(tmp_path):
    assert cpu_quota(_cgroup_v2(tmp_path, "400000 100000\n")) == 4.0
    assert cpu_quota(_cgroup_v2(tmp_path, "max 100000\n")) is None


def test_a_v1_quota_is_read_when_there_is_no_v2_file(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("250000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_quota(tmp_path) == 2.5
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_quota(tmp_path) is None


def test_no_cgroup_files_mean_no_limit(tmp_path):
    assert cpu_quota(tmp_path) is None
    assert cpus_available(tmp_path) == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("quota, expected", [("100000 100000", 1), ("150000 100000", 2), ("50000 100000", 1)])
def test_the_quota_caps_the_threads_rounded_up(tmp_path, quota, expected):
    root = _cgroup_v2(tmp_path, quota)
    affinity = len(os.sched_getaffinity(0))
    assert cpus_available(root) == min(affinity, expected)
    assert threads_within_limit(16, root) == min(affinity, expected)
    assert threads_within_limit(1, root) == 1  # fewer than the limit: as asked


@pytest.mark.parametrize("shared_by, expected", [(1, 8), (2, 4), (3, 2), (8, 1), (16, 1)])
def test_a_pods_cpus_are_split_among_the_workers_it_holds(tmp_path, monkeypatch, shared_by, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(32)))  # a 32-core node...
    root = _cgroup_v2(tmp_path, "800000 100000")  # ...whose pod may use 8 of them
    assert threads_for_share(shared_by, root) == expected
    with pytest.raises(ValueError, match="shared_by"):
        threads_for_share(0, root)


def test_a_worker_placed_by_its_role_resource_splits_its_own_nodes_cpus():
    """A real Ray node offering 2 units of oasiskv_decode (two workers share it): each takes half
    of the CPUs this process may use, whatever the head computed; with no role resource (one
    machine) the threads are left as asked."""
    script = (
        "import json, ray\n"
        "from oasiskv.models.cpus import cpus_available, worker_threads\n"
        "ray.init(num_cpus=1, resources={'oasiskv_decode': 2, 'oasiskv_prefill': 1}, include_dashboard=False,\n"
        "         log_to_driver=False)\n"
        "@ray.remote(num_cpus=0)\n"
        "def threads(resource):\n"
        "    return worker_threads(None, resource), worker_threads(1, resource), cpus_available()\n"
        "print(json.dumps([ray.get(threads.remote(r)) for r in ('oasiskv_decode', 'oasiskv_prefill', None)]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (decode, decode_asked, cpus), (prefill, _, _), (unplaced, unplaced_asked, _) = json.loads(
        done.stdout.strip().splitlines()[-1])
    assert decode == max(1, cpus // 2) and prefill == cpus
    assert decode_asked == 1 and unplaced is None and unplaced_asked == 1
