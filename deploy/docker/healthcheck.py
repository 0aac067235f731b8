"""Container health check for every OasisKV role (Docker HEALTHCHECK, Kubernetes exec probes).

The entrypoint records the role it started in a state file, because a health check runs as a
separate process that cannot see the entrypoint's variables. Exit 0 = healthy.

  api PORT               GET /health on the local API answers 2xx
  worker ROLE HEAD:PORT  a raylet runs in this container and the head's GCS accepts connections
  kvstore PORT           the store's control port accepts connections

Standard library only: the check must not pay for importing torch or Ray every few seconds.
"""

from __future__ import annotations

import os
import socket
import sys
import urllib.request
from pathlib import Path

TIMEOUT_S = 3.0


def _tcp_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=TIMEOUT_S):
            return True
    except OSError:
        return False


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:  # noqa: S310 (loopback)
            return 200 <= response.status < 300
    except OSError:
        return False


def _raylet_running(proc: Path = Path("/proc")) -> bool:
    for cmdline in proc.glob("[0-9]*/cmdline"):
        try:
            argv0 = cmdline.read_bytes().split(b"\0", 1)[0]
        except OSError:  # the process exited while we looked
            continue
        if argv0.endswith(b"/raylet") or argv0 == b"raylet":
            return True
    return False


def check(state: list[str], proc: Path = Path("/proc")) -> tuple[bool, str]:
    if not state:
        return False, "no role recorded yet (still starting)"
    role, args = state[0], state[1:]
    if role == "api":
        url = f"http://127.0.0.1:{args[0]}/health"
        return _http_ok(url), url
    if role == "worker":
        head = args[1] if len(args) > 1 else ""
        if not _raylet_running(proc):
            return False, "no raylet process"
        if head:
            host, _, port = head.rpartition(":")
            if not _tcp_open(host, int(port)):
                return False, f"Ray head {head} unreachable"
        return True, f"raylet up, head {head or '?'}"
    if role == "kvstore":
        return _tcp_open("127.0.0.1", int(args[0])), f"store port {args[0]}"
    return True, f"role {role!r} has no check"


def main() -> int:
    path = Path(os.environ.get("OASISKV_STATE_FILE", "/tmp/oasiskv-role"))
    try:
        state = path.read_text().split()
    except OSError:
        state = []
    healthy, detail = check(state)
    print(("healthy: " if healthy else "unhealthy: ") + detail)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
