"""The CPUs a worker may use: the cgroup quota a container's CPU limit sets caps the threads the
API asked for (it computed them from the head node's cores)."""

from __future__ import annotations

import os

import pytest

from oasiskv.models.cpus import cpu_quota, cpus_available, threads_within_limit


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
