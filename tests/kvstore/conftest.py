"""Fixtures for the KV store suite: an in-process server and clients over every transport."""

from __future__ import annotations

import pytest

from oasiskv.kvstore import KVStoreServer, connect
from oasiskv.kvstore.nixl_transport import nixl_available

TRANSPORTS = ["inproc", "tcp", "nixl"]
REMOTE_TRANSPORTS = ["tcp", "nixl"]


def transport_param(name: str):
    marks = [pytest.mark.skipif(not nixl_available(), reason="nixl not importable")] if name == "nixl" else []
    return pytest.param(name, marks=marks, id=name)


@pytest.fixture(scope="module")
def server():
    srv = KVStoreServer(capacity_bytes=64 << 20, ttl_s=600, prefault=False)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(params=[transport_param(t) for t in TRANSPORTS])
def client(request, server):
    c = connect(server, transport=request.param, timeout=10)
    yield c
    c.close()
