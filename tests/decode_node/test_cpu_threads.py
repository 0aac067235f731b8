"""The block bookkeeping runs on one intra-op thread and gives the others back afterwards."""

from __future__ import annotations

import pytest
import torch

from oasiskv.decode_node.attention import one_cpu_thread


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_one_thread_inside_and_the_count_restored_after(two_threads):
    with one_cpu_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2


def test_the_count_is_restored_when_the_body_raises(two_threads):
    with pytest.raises(RuntimeError, match="boom"):
        with one_cpu_thread():
            raise RuntimeError("boom")
    assert torch.get_num_threads() == 2


def test_nesting_keeps_one_thread_until_the_outermost_exits(two_threads):
    with one_cpu_thread():
        with one_cpu_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
