"""Peers that lie, stall or hoard: each costs the store only what it really sent, for a bounded
time, and gets a named error; the store keeps serving everyone else."""

from __future__ import annotations

import json
import socket
import time

import numpy as np
import pytest

from oasiskv.kvstore import connect
from oasiskv.kvstore.protocol import MAGIC, PREFIX, recv_frame_header

from .helpers import LAYOUT, store_process


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_frame_that_only_claims_a_big_payload_costs_the_store_no_memory():
    """A 'hello' and a 'read' that each claimed 512 MiB and sent 16 bytes raised the store's RSS
    by 512 MiB each: the payload buffer was allocated whole before any of it arrived."""
    claim = 512 << 20
    with store_process() as (proc, address):
        host, port = address.rsplit(":", 1)
        before = rss_bytes(proc.pid)
        socks = []
        for header in ({"op": "hello", "version": 2, "nixl": True, "seq": 1},
                       {"op": "read", "rid": "x", "n": claim // 12, "seq": 1}):
            sock = socket.create_connection((host, int(port)), timeout=10)
            head = json.dumps(header).encode()
            sock.sendall(PREFIX.pack(MAGIC, len(head), claim) + head + b"\0" * 16)
            socks.append(sock)
        time.sleep(1.5)
        grown = rss_bytes(proc.pid) - before
        assert grown < 64 << 20, f"store RSS grew by {grown >> 20} MiB for 32 bytes received"
        with connect(address, transport="tcp", timeout=5) as c:
            assert c.stats().num_requests == 0
        for sock in socks:
            sock.close()
