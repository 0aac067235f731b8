"""Processes that share one store process: bit-exact across processes, concurrently."""

from __future__ import annotations

import json
import subprocess
import sys


from oasiskv.kvstore import connect
from oasiskv.kvstore.nixl_transport import nixl_available

from .helpers import REPO_ROOT, store_process

REMOTE = ["tcp", "nixl"] if nixl_available() else ["tcp"]


def start_worker(*args: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.kvstore.kv_worker", *map(str, args)],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(procs: list[subprocess.Popen], timeout: float = 90) -> list[dict]:
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            assert proc.returncode == 0 and lines, f"worker failed (rc={proc.returncode}): {out[-1000:]} {err[-2000:]}"
            results.append(json.loads(lines[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def test_processes_write_and_read_each_others_requests_concurrently():
    with store_process() as (_proc, address):
        # Wave 1: one writer per transport, at the same time.
        writers = [start_worker("write", address, transport, 10 + i, f"mp-{transport}", 300 + 17 * i)
                   for i, transport in enumerate(REMOTE)]
        finish(writers)
        # Wave 2: each request read back by the *other* transport's process, in random order,
        # while another process writes a third request.
        readers = [start_worker("read", address, REMOTE[(i + 1) % len(REMOTE)], 10 + i, f"mp-{transport}", 300 + 17 * i, "--free")
                   for i, transport in enumerate(REMOTE)]
        readers.append(start_worker("write", address, REMOTE[-1], 77, "mp-third", 500))
        results = finish(readers)
        assert all(r["ok"] for r in results), results
        # Wave 3: the third request, and the freed memory is reused by a new one.
        results = finish([start_worker("read", address, REMOTE[0], 77, "mp-third", 500, "--free")])
        assert results[0]["ok"] and results[0]["units"] > 0
        with connect(address, transport="tcp") as client:
            stats = client.stats()
            assert stats.used_bytes == 0 and stats.num_requests == 0 and stats.free_extents == 1
