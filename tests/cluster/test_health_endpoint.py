"""GET /health over the slots' health, as the poll set it (stand-in actor handles): `degraded`
answers 200 while every role still has a healthy worker, so a readiness probe keeps an API that
serves in its Service; only a role with no healthy worker left makes it 503. Before, one
unhealthy worker of two answered 503, and Kubernetes sent no traffic to a cluster that served."""

from __future__ import annotations

from fastapi.testclient import TestClient

from oasiskv.cluster.api import create_app
from oasiskv.cluster.config import ServeConfig
from oasiskv.cluster.launcher import ClusterHandles
from oasiskv.cluster.router import WorkerSlot
from oasiskv.cluster.service import ClusterService

from .test_health_poll import StandInActor


def make_client():
    slots = {name: WorkerSlot(name, StandInActor({"healthy": True}))
             for name in ("prefill-0", "decode-0", "decode-1", "store-0")}
    handles = ClusterHandles([slots["prefill-0"]], [slots["decode-0"], slots["decode-1"]], [slots["store-0"]])
    service = ClusterService(ServeConfig(), handles, tokenizer=None, kv_bytes_per_token=1, max_model_len=2048)
    return TestClient(create_app(service)), slots


def test_all_healthy_is_ok():
    client, _ = make_client()
    response = client.get("/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_one_of_two_decode_workers_down_is_degraded_but_ready():
    client, slots = make_client()
    slots["decode-1"].healthy = False
    response = client.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "degraded", "unhealthy": ["decode-1"]}


def test_a_role_with_no_healthy_worker_is_unavailable():
    client, slots = make_client()
    slots["decode-1"].healthy = False
    slots["store-0"].healthy = False
    response = client.get("/health")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unavailable" and body["unhealthy"] == ["decode-1", "store-0"]
    assert body["message"] == "no healthy store worker"
    slots["decode-0"].healthy = False
    assert client.get("/health").json()["message"] == "no healthy decode or store worker"
