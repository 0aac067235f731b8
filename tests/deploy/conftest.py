"""Shared helpers of the deployment checks: where the repository and the deploy tools are.

The tools (helm, promtool, prometheus, docker-compose, kubernetes-validate) come from
scripts/install-deploy-tools.sh into ./.tools/bin; a test that needs one is skipped, naming the
script, only when the tool is absent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS_BIN = REPO / ".tools" / "bin"


def find_tool(name: str) -> str | None:
    local = TOOLS_BIN / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which(name)


def require_tool(name: str) -> str:
    path = find_tool(name)
    if path is None:
        pytest.skip(f"{name} is not installed: run `bash scripts/install-deploy-tools.sh`")
    return path


def run(argv: list[str], timeout: float = 120, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """Run a tool; on failure the assertion message carries its whole output."""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check:
        assert result.returncode == 0, (
            f"{' '.join(map(str, argv))} exited {result.returncode}\n"
            f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
        )
    return result


def start_prometheus(target: str, work: Path,
                     namespaces: Iterable[str | None] = (None,)) -> tuple[subprocess.Popen, str]:
    """A real Prometheus on loopback scraping `target` (host:port) every second, once for each of
    `namespaces`: None scrapes as docker compose does, with no `namespace` label; a name labels
    the series as the Prometheus operator labels a release's, so one exporter stands for several
    releases. Returns the process and its base URL. The caller terminates it."""
    import socket

    import yaml

    binary = require_tool("prometheus")
    jobs = []
    for namespace in namespaces:
        targets = {"targets": [target]} | ({"labels": {"namespace": namespace}} if namespace else {})
        jobs.append({"job_name": "oasiskv-api" + (f"-{namespace}" if namespace else ""), "static_configs": [targets]})
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
        "scrape_configs": jobs,
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        [binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    return process, f"http://127.0.0.1:{port}"
