import pytest

from oasiskv.kvstore import KVStoreServer


@pytest.fixture(scope="module")
def store():
    """A real store over TCP for a module's prefills (each test frees what it wrote)."""
    server = KVStoreServer(capacity_bytes=512 * 2**20, prefault=False, transport="tcp")
    server.start()
    yield server
    server.stop()
