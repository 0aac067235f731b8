"""`oasiskv serve --address HOST:PORT --placement resources` on a Ray cluster of several nodes,
as the Helm chart runs it: a head that offers no role, and a node per role that advertises
oasiskv_store / oasiskv_prefill / oasiskv_decode (a KubeRay worker group each). The nodes are
real raylets on this machine (Ray's own `cluster_utils.Cluster`), so each role runs on the
node that offers its resource, and the store is reached at the address it advertises."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from ..conftest import DEFAULT_MODEL
from .test_shutdown import _free_port, _wait_healthy

ROLE_RESOURCES = ("oasiskv_store", "oasiskv_prefill", "oasiskv_decode")

# Four raylets, a serve process and two lost nodes: out of the default suite, which it took past
# 25 minutes, and run by .ci/run on its own after it (`bash scripts/test.sh -m slow
# tests/cluster/test_multi_node.py`).
pytestmark = pytest.mark.slow


@pytest.fixture
def ray_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    role_nodes = {resource: cluster.add_node(num_cpus=0, resources={resource: 1}) for resource in ROLE_RESOURCES}
    try:
        yield cluster, role_nodes
    finally:
        cluster.shutdown()


def _role_resources_left(address: str) -> dict[str, float]:
    """What each role resource has left, from a short-lived driver (ray.init in this process
    would stay connected to a cluster the fixture shuts down)."""
    script = ("import json, ray; ray.init(address=%r, log_to_driver=False); "
              "left = ray.available_resources(); print(json.dumps({r: left.get(r, 0.0) for r in %r}))"
              % (address, ROLE_RESOURCES))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    import json

    return json.loads(done.stdout.strip().splitlines()[-1])


def _complete(url: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.completions.create(model=DEFAULT_MODEL, prompt="def fibonacci(n):", max_tokens=12, temperature=0)
    return reply.choices[0].text


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"not within {timeout_s:g} s: {what}")


def test_each_role_runs_on_the_node_that_offers_it_and_a_lost_node_is_replaced(ray_cluster):
    cluster, role_nodes = ray_cluster
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "oasiskv.cluster.cli", "serve", "--address", cluster.address, "--placement", "resources",
         "--port", str(port), "--threads-per-worker", "1", "--start-timeout-s", "300"],
        # No RAY_AUTH_MODE of its own: serve must join with the cluster's auth mode, which this
        # process passes on (once a test here has started Ray in-process, Ray has exported
        # RAY_AUTH_MODE=token). Forcing 'disabled' made ray.init fail against that cluster
        # ("Failed to connect to Ray cluster"): serve exited 1 in a whole-suite CI run.
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        try:
            _wait_healthy(url, proc)
        except AssertionError:
            proc.kill()
            raise AssertionError(f"serve did not come up: {proc.communicate()[1][-3000:]}") from None
        # Every role resource is held: each actor sits on the one node that offers it.
        assert _role_resources_left(cluster.address) == dict.fromkeys(ROLE_RESOURCES, 0.0)
        expected = _complete(url)
        assert expected.strip(), "an empty completion"

        # A role's node is lost (its pod evicted). Ray restarts the role's actor on the next node
        # that offers its resource; a store comes back empty at a new address, which the health
        # poll must pick up, and a decode worker reloads its model.
        for resource in ("oasiskv_store", "oasiskv_decode"):
            cluster.remove_node(role_nodes[resource], allow_graceful=False)
            _wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 503, 60,
                      f"/health unavailable without {resource}")
            cluster.add_node(num_cpus=0, resources={resource: 1})
            _wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, 180,
                      f"/health ok again with a new {resource} node")
            assert _complete(url) == expected  # greedy: the same tokens through the new node
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
    assert proc.returncode in (0, 15, -signal.SIGTERM), stderr[-3000:]  # uvicorn re-raises the signal's code
    # serve's actors are gone with it: every role resource is free for the next deployment.
    assert _role_resources_left(cluster.address) == dict.fromkeys(ROLE_RESOURCES, 1.0)
