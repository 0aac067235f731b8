"""Helm chart: `helm lint`, `helm template` for each value set under helm/oasiskv/ci, strict
validation of the output, and the wiring between the objects.

Built-in kinds go through `kubernetes-validate --strict`. It does not know custom resources
(it only warns), so those are checked here instead: RayCluster, ServiceMonitor, PodMonitor and
PrometheusRule against the schema subsets in helm/oasiskv/crd-schema (written from the
operators' CRDs), and every RayCluster pod template, wrapped in a core/v1 PodTemplate, again
with `kubernetes-validate --strict`. A kind that neither path knows fails the test.
"""

from __future__ import annotations

import base64
import http.server
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import jsonschema
import pytest
import yaml

from .conftest import REPO, require_tool, run

CHART = REPO / "helm" / "oasiskv"
VALUE_SETS = {"default": None, **{p.stem.removesuffix("-values"): p for p in sorted((CHART / "ci").glob("*.yaml"))}}
CRD_SCHEMAS = {
    "RayCluster": CHART / "crd-schema" / "raycluster.v1.json",
    "ServiceMonitor": CHART / "crd-schema" / "monitoring.coreos.com.v1.json",
    "PodMonitor": CHART / "crd-schema" / "monitoring.coreos.com.v1.json",
    "PrometheusRule": CHART / "crd-schema" / "monitoring.coreos.com.v1.json",
}
# Kubernetes versions the output must be valid for: a common older cluster and the newest known.
KUBERNETES_VERSIONS = ["1.28.0", "1.37.0"]
ROLES = ("prefill", "decode", "store")


def helm_template(values: Path | None, *extra: str, check: bool = True):
    argv = [require_tool("helm"), "template", "oasis", str(CHART), "--namespace", "llm"]
    if values is not None:
        argv += ["--values", str(values)]
    return run(argv + list(extra), check=check)


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request) -> tuple[str, list[dict]]:
    output = helm_template(VALUE_SETS[request.param]).stdout
    return request.param, [doc for doc in yaml.safe_load_all(output) if doc]


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def kinds(docs: list[dict]) -> set[str]:
    return {d["kind"] for d in docs}


def head_args(cluster: dict) -> dict[str, str]:
    args = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "head"
    flags = args[1:]
    return {flags[i]: flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("--") else ""
            for i in range(len(flags)) if flags[i].startswith("--")}


def ray_resources(group: dict) -> dict[str, int]:
    """rayStartParams.resources is JSON in single quotes, the form KubeRay itself writes."""
    value = group["rayStartParams"]["resources"]
    assert value.startswith("'") and value.endswith("'"), value
    return json.loads(value[1:-1])


def pod_templates(cluster: dict) -> list[tuple[str, dict]]:
    spec = cluster["spec"]
    return [("head", spec["headGroupSpec"]["template"])] + [
        (g["groupName"], g["template"]) for g in spec["workerGroupSpecs"]]


def kubernetes_validate(docs: list[dict], tmp_path: Path) -> None:
    tool = require_tool("kubernetes-validate")
    path = tmp_path / "manifests.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    for version in KUBERNETES_VERSIONS:
        result = run([tool, "--strict", "-k", version, str(path)], check=False)
        problems = [line for line in result.stdout.splitlines() if not line.startswith("INFO")]
        assert result.returncode == 0 and not problems, result.stdout + result.stderr
        assert result.stdout.count(" passed ") == len(docs), result.stdout


# --- lint and validation -------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_helm_lint_strict(name):
    argv = [require_tool("helm"), "lint", "--strict", str(CHART)]
    if VALUE_SETS[name] is not None:
        argv += ["--values", str(VALUE_SETS[name])]
    assert "0 chart(s) failed" in run(argv).stdout


def test_builtin_kinds_pass_kubernetes_validate_strict(rendered, tmp_path):
    _, docs = rendered
    builtin = [d for d in docs if d["kind"] not in CRD_SCHEMAS]
    assert builtin
    kubernetes_validate(builtin, tmp_path)


def test_raycluster_pod_templates_pass_kubernetes_validate_strict(rendered, tmp_path):
    _, docs = rendered
    cluster = one(docs, "RayCluster")
    wrapped = [{"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"template-{group}"},
                "template": template} for group, template in pod_templates(cluster)]
    kubernetes_validate(wrapped, tmp_path)


def test_custom_resources_match_their_crd_schema(rendered):
    _, docs = rendered
    for doc in docs:
        if doc["kind"] in CRD_SCHEMAS:
            schema = json.loads(CRD_SCHEMAS[doc["kind"]].read_text())
            jsonschema.Draft202012Validator.check_schema(schema)
            jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)


def test_crd_schema_catches_a_misspelt_field(rendered):
    _, docs = rendered
    cluster = json.loads(json.dumps(one(docs, "RayCluster")))
    cluster["spec"]["workerGroupSpecs"][0]["minReplica"] = 1
    schema = json.loads(CRD_SCHEMAS["RayCluster"].read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(cluster, schema, cls=jsonschema.Draft202012Validator)
    cluster = json.loads(json.dumps(one(docs, "RayCluster")))
    cluster["spec"]["workerGroupSpecs"][0]["rayStartParams"]["num-cpus"] = 2  # must be a string
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(cluster, schema, cls=jsonschema.Draft202012Validator)


def test_values_schema_rejects_bad_values():
    for bad in ("workers.decode.replicas=0", "serve.mode=fast", "serve.prefillEngine=sglang", "image.device=tpu",
                "serve.device=gpu",
                # Ray's head binds these (GCS, client server, worker processes, dashboard agent).
                "serve.port=6379", "serve.port=10001", "serve.port=15000", "serve.port=52365",
                "serve.shutdownGraceSeconds=0",
                "networkPolicy.apiFrom[0].podSelectr.a=b"):
        result = helm_template(None, "--set", bad, check=False)
        assert result.returncode != 0 and "schema" in result.stderr, (bad, result.stderr)


# --- wiring --------------------------------------------------------------------------------------

def test_serve_worker_counts_and_placement_match_the_worker_groups(rendered):
    name, docs = rendered
    cluster = one(docs, "RayCluster")
    args = head_args(cluster)
    assert args["--placement"] == "resources"
    assert "--address" not in args  # the entrypoint adds `--address auto` after starting the head
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert set(groups) == set(ROLES)
    flag = {"prefill": "--prefill-workers", "decode": "--decode-workers", "store": "--stores"}
    for role, group in groups.items():
        resources = ray_resources(group)
        assert set(resources) == {f"oasiskv_{role}"}, (name, role, resources)
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"]
        assert int(args[flag[role]]) == group["replicas"] * resources[f"oasiskv_{role}"], (name, role)
    assert cluster["spec"]["enableInTreeAutoscaling"] is False


def test_every_ray_container_runs_the_entrypoint_with_overwritten_kuberay_command(rendered):
    _, docs = rendered
    cluster = one(docs, "RayCluster")
    for group, template in pod_templates(cluster):
        assert template["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
        container = template["spec"]["containers"][0]
        assert container["command"] == ["/usr/bin/tini", "--", "/opt/oasiskv/entrypoint.sh"]
        assert container["args"][0] == ("head" if group == "head" else "kuberay")
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == 8080, group  # otherwise KubeRay appends its own
        # explicit probes: KubeRay's injected ones wget the Ray dashboard, which the head does not run
        assert {"livenessProbe", "readinessProbe", "startupProbe"} <= container.keys()
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/dev/shm" in mounts
        if group == "head":
            # a cluster that cannot serve (/health 503) leaves the Service, but the head is not restarted
            assert container["readinessProbe"]["httpGet"]["path"] == "/health"
            assert "tcpSocket" in container["livenessProbe"]
        else:
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["OASISKV_ROLE"] == group


def effective_values(name: str) -> dict:
    """values.yaml overlaid with the value set, as Helm merges them (maps deep, lists replaced)."""
    def overlay(base, top):
        if isinstance(base, dict) and isinstance(top, dict):
            return {k: overlay(base.get(k), top[k]) if k in top else base[k] for k in base.keys() | top.keys()}
        return top
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    return overlay(values, yaml.safe_load(VALUE_SETS[name].read_text())) if VALUE_SETS[name] else values


def test_gpus_requested_exactly_where_configured(rendered):
    name, docs = rendered
    cluster = one(docs, "RayCluster")
    values = effective_values(name)
    for group, template in pod_templates(cluster):
        resources = template["spec"]["containers"][0]["resources"]
        configured = values["head"] if group == "head" else values["workers"][group]
        wanted = configured.get("gpus", 0)
        for kind in ("limits", "requests"):
            assert resources.get(kind, {}).get("nvidia.com/gpu", 0) == wanted, (name, group, kind)
            others = {k: v for k, v in resources.get(kind, {}).items() if k != "nvidia.com/gpu"}
            assert others == configured["resources"][kind], (name, group, kind)
    if name == "gpu-cluster":
        assert {g: one_gpu(t) for g, t in pod_templates(cluster)} == {
            "head": 0, "prefill": 1, "decode": 1, "store": 0}
        image = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
        assert image.endswith("-cuda")


def one_gpu(template: dict) -> int:
    return template["spec"]["containers"][0]["resources"].get("limits", {}).get("nvidia.com/gpu", 0)


def test_api_service_and_monitors_select_what_exists(rendered):
    name, docs = rendered
    cluster = one(docs, "RayCluster")
    head = cluster["spec"]["headGroupSpec"]["template"]
    service = one(docs, "Service")
    assert service["spec"]["selector"].items() <= head["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    head_ports = {p["name"] for p in head["spec"]["containers"][0]["ports"]}
    assert port["targetPort"] in head_ports
    if "ServiceMonitor" in kinds(docs):
        monitor = one(docs, "ServiceMonitor")
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert monitor["spec"]["endpoints"][0]["port"] == port["name"]
        assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "oasiskv-api"
    if "PodMonitor" in kinds(docs):
        monitor = one(docs, "PodMonitor")
        for group, template in pod_templates(cluster):
            assert monitor["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
            # Prometheus names the job after this pod label; without it, after the PodMonitor
            assert template["metadata"]["labels"].get(monitor["spec"]["jobLabel"]) == "ray-nodes", group


def test_network_policy_keeps_ray_and_nixl_inside_the_release(rendered):
    name, docs = rendered
    policies = {d["metadata"]["name"].rsplit("-", 1)[-1]: d for d in docs if d["kind"] == "NetworkPolicy"}
    if name == "minimal":
        assert not policies
        return
    cluster = one(docs, "RayCluster")
    internal = policies["internal"]["spec"]
    release = internal["podSelector"]["matchLabels"]
    assert release["app.kubernetes.io/instance"] == "oasis"
    for _, template in pod_templates(cluster):
        assert release.items() <= template["metadata"]["labels"].items()
    # any port (Ray and NIXL pick some at run time), but only from pods of this release
    (rule,) = internal["ingress"]
    assert "ports" not in rule and rule["from"] == [{"podSelector": {"matchLabels": release}}]
    for extra in ("api", "metrics"):
        for rule in policies.get(extra, {"spec": {"ingress": []}})["spec"]["ingress"]:
            assert {p["port"] for p in rule["ports"]} <= {"api", "metrics"}, "only API/metrics ports open"
    assert policies["api"]["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "head"


def test_dashboards_and_rules_are_the_deploy_files(rendered):
    name, docs = rendered
    if name == "minimal":
        assert not kinds(docs) & {"ConfigMap", "PrometheusRule", "ServiceMonitor", "PodMonitor"}
        return
    configmap = one(docs, "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = {p.name: p.read_text() for p in (REPO / "deploy" / "grafana" / "dashboards").glob("*.json")}
    assert {k: json.loads(v) for k, v in configmap["data"].items()} == {k: json.loads(v) for k, v in files.items()}
    rules = yaml.safe_load((REPO / "deploy" / "prometheus" / "rules" / "oasiskv.rules.yml").read_text())
    assert one(docs, "PrometheusRule")["spec"]["groups"] == rules["groups"]


def test_api_key_comes_from_a_secret(rendered):
    name, docs = rendered
    cluster = one(docs, "RayCluster")
    env = {e["name"]: e for e in cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]}
    secrets = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-api-key")]
    if name == "cpu-demo":
        (secret,) = secrets
        ref = env["OASISKV_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret["metadata"]["name"]
        assert base64.b64decode(secret["data"][ref["key"]]) == b"demo-key"
    elif name == "gpu-cluster":
        assert not secrets
        assert env["OASISKV_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "oasiskv-api-key", "key": "key"}
    else:
        assert not secrets and "OASISKV_API_KEY" not in env
    assert "--api-key" not in head_args(cluster), "the key must not appear in the manifest"


def test_model_cache_volume_follows_values(rendered):
    name, docs = rendered
    cluster = one(docs, "RayCluster")
    for _, template in pod_templates(cluster):
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        if name == "minimal":
            assert "model-cache" not in volumes
        elif name == "gpu-cluster":
            claim = volumes["model-cache"]["persistentVolumeClaim"]["claimName"]
            pvc = one(docs, "PersistentVolumeClaim")
            assert claim == pvc["metadata"]["name"]
            assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
        else:
            assert "emptyDir" in volumes["model-cache"]


def test_packaged_chart_resolves_the_linked_files_and_leaves_out_test_schemas(tmp_path):
    run([require_tool("helm"), "package", str(CHART), "--destination", str(tmp_path)])
    (package,) = tmp_path.glob("oasiskv-*.tgz")
    with tarfile.open(package) as archive:
        names = set(archive.getnames())
    assert "oasiskv/files/dashboards/oasiskv-overview.json" in names
    assert "oasiskv/files/prometheus-rules/oasiskv.rules.yml" in names
    assert not any("crd-schema" in n for n in names)


def test_every_ray_process_shares_one_ray_auth_token(rendered):
    """Ray 2.60 turns token authentication on by itself when it finds a token file; the release
    says which mode it wants and hands every Ray container (and so KubeRay's wait-for-GCS init
    container, which copies the Ray container's environment) the same token."""
    name, docs = rendered
    cluster = one(docs, "RayCluster")
    values = effective_values(name)
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    refs = set()
    for group, template in pod_templates(cluster):
        env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == ("token" if values["rayAuth"]["enabled"] else "disabled")
        ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        refs.add((ref["name"], ref["key"]))
    (secret_name, key), = refs
    if values["rayAuth"]["existingSecret"]:
        assert secret_name == values["rayAuth"]["existingSecret"] and secret_name not in secrets
    else:
        token = base64.b64decode(secrets[secret_name]["data"][key])
        assert len(token) == 48 and token.isalnum()


def test_ray_auth_can_be_disabled_explicitly():
    docs = [d for d in yaml.safe_load_all(helm_template(None, "--set", "rayAuth.enabled=false").stdout) if d]
    cluster = one(docs, "RayCluster")
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-ray-auth")]
    for _, template in pod_templates(cluster):
        env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "disabled" and "RAY_AUTH_TOKEN" not in env


def test_prefill_engine_reaches_oasiskv_serve():
    for engine in ("oasiskv", "vllm"):
        docs = [d for d in yaml.safe_load_all(helm_template(None, "--set", f"serve.prefillEngine={engine}").stdout) if d]
        assert head_args(one(docs, "RayCluster"))["--prefill-engine"] == engine


def test_the_head_pod_outlives_the_apis_shutdown_grace():
    """Kubernetes kills the head after terminationGracePeriodSeconds; the API must have aborted its
    requests and shut the Ray actors down before that."""
    for grace in (30, 300):
        docs = [d for d in yaml.safe_load_all(
            helm_template(None, "--set", f"serve.shutdownGraceSeconds={grace}").stdout) if d]
        cluster = one(docs, "RayCluster")
        assert head_args(cluster)["--shutdown-grace-s"] == str(grace)
        pod = cluster["spec"]["headGroupSpec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == grace + 30


def test_the_head_startup_probe_waits_out_the_model_pull_and_serves_start_timeout():
    """The probe allowed 900 s while `oasiskv serve` could wait 600 s per role for its workers
    (and then the pull): on a cluster whose GPU nodes take a while to scale up, the kubelet killed
    the head, and with it the whole cluster, over and over."""
    for start, pull in ((1200, 600), (3600, 0), (95, 1)):
        docs = [d for d in yaml.safe_load_all(helm_template(
            None, "--set", f"serve.startTimeoutSeconds={start}", "--set", f"modelCache.pullSeconds={pull}").stdout) if d]
        cluster = one(docs, "RayCluster")
        assert head_args(cluster)["--start-timeout-s"] == str(start)
        probe = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["startupProbe"]
        allowed = probe["periodSeconds"] * probe["failureThreshold"]
        assert start + pull + 60 <= allowed < start + pull + 60 + probe["periodSeconds"], (start, pull, allowed)
    assert helm_template(None, "--set", "serve.startTimeoutSeconds=0", check=False).returncode != 0


def test_serve_device_follows_the_image_and_gives_each_worker_its_pods_gpu_share(rendered):
    name, docs = rendered
    args = head_args(one(docs, "RayCluster"))
    values = effective_values(name)
    device = values["serve"].get("device") or values["image"]["device"]
    assert args["--device"] == device, name
    if device == "cuda":
        groups = [values["workers"][role] for role in ("prefill", "decode")]
        assert float(args["--gpus-per-worker"]) == min(1, *(g["gpus"] / g["rayResourceUnits"] for g in groups))
    else:
        assert "--gpus-per-worker" not in args
    if name == "gpu-cluster":
        assert args["--device"] == "cuda"


def test_two_decode_workers_per_gpu_pod_ask_for_half_a_gpu_each():
    gpu_values = VALUE_SETS["gpu-cluster"]
    docs = [d for d in yaml.safe_load_all(helm_template(gpu_values, "--set", "workers.decode.rayResourceUnits=2").stdout) if d]
    args = head_args(one(docs, "RayCluster"))
    assert (args["--device"], args["--gpus-per-worker"]) == ("cuda", "0.5")


def test_cuda_workers_without_gpus_or_without_the_cuda_image_are_refused():
    gpu_values = VALUE_SETS["gpu-cluster"]
    for values, setting, message in (
        (None, "serve.device=cuda", "set image.device=cuda"),
        (gpu_values, "workers.decode.gpus=0", "workers.decode.gpus >= 1"),
        (None, "image.device=cuda", "workers.prefill.gpus >= 1"),
    ):
        result = helm_template(values, "--set", setting, check=False)
        assert result.returncode != 0 and message in result.stderr, (setting, result.stderr)
    # A CUDA image may still run its workers on CPU.
    docs = [d for d in yaml.safe_load_all(
        helm_template(None, "--set", "image.device=cuda", "--set", "serve.device=cpu").stdout) if d]
    assert head_args(one(docs, "RayCluster"))["--device"] == "cpu"


def test_the_helm_test_pod_pulls_like_the_cluster_and_extra_args_may_be_numbers():
    """The test pod had no imagePullSecrets (ImagePullBackOff from a private registry), and the
    schema refused a number in serve.extraArgs ([--store-ttl-s, 300])."""
    output = helm_template(None, "--set", "imagePullSecrets[0].name=regcred",
                           "--set-json", 'serve.extraArgs=["--store-ttl-s", 300]').stdout
    docs = [d for d in yaml.safe_load_all(output) if d]
    test_pod = next(d for d in docs if d["kind"] == "Pod" and d["metadata"]["name"].endswith("-test-api"))
    assert test_pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert head_args(one(docs, "RayCluster"))["--store-ttl-s"] == "300"


def test_whole_numbers_in_extra_args_from_a_values_file_reach_serve_as_integers(tmp_path):
    """A values file's numbers are float64 to Helm: 1000000 was passed as "1e+06", which
    `oasiskv serve --max-queued-requests` refused, and the head crash-looped."""
    values = tmp_path / "values.yaml"
    values.write_text('serve:\n  extraArgs: ["--max-queued-requests", 1000000, "--store-ttl-s", 300, '
                      '"--draft-temperature", 0.5]\n')
    args = head_args(one([d for d in yaml.safe_load_all(helm_template(values).stdout) if d], "RayCluster"))
    assert (args["--max-queued-requests"], args["--store-ttl-s"], args["--draft-temperature"]) == ("1000000", "300", "0.5")


def test_store_arenas_that_outgrow_their_pods_memory_limit_are_refused():
    """A store pod holds rayResourceUnits arenas of serve.storeCapacityGb GiB; past the pod's
    memory limit the kernel kills it with every request's KV. Nothing compared the two."""
    def render(*sets: str):
        return helm_template(None, *[arg for s in sets for arg in ("--set-json", s)], check=False)

    for refused in (["serve.storeCapacityGb=8"],  # 8 GiB + 1 for Ray in an 8Gi pod
                    ["workers.store.rayResourceUnits=2"],  # two 4 GiB arenas
                    ["serve.storeCapacityGb=7.5", 'workers.store.resources.limits.memory="8192Mi"']):
        result = render(*refused)
        assert result.returncode != 0 and "workers.store.resources.limits.memory" in result.stderr, refused
    for accepted in ([], ["serve.storeCapacityGb=6.5", 'workers.store.resources.limits.memory="8192Mi"'],
                     ["serve.storeCapacityGb=8", 'workers.store.resources.limits.memory="16G"'],
                     ["workers.store.rayResourceUnits=2", 'workers.store.resources.limits.memory="10Gi"']):
        assert render(*accepted).returncode == 0, accepted


def test_notes_warn_when_every_pod_shares_a_read_write_once_model_cache(tmp_path):
    """`helm template` leaves NOTES.txt out and `helm install --dry-run` needs a cluster, so the
    warning NOTES.txt prints is rendered here through a ConfigMap added to a copy of the chart."""
    chart = tmp_path / "oasiskv"
    shutil.copytree(CHART, chart, symlinks=False)
    assert 'include "oasiskv.modelCacheWarning"' in (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "warning.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: warning}\n'
        'data: {text: {{ include "oasiskv.modelCacheWarning" . | quote }}}\n')

    def warning(*sets: str) -> str:
        argv = [require_tool("helm"), "template", "oasis", str(chart), "--show-only", "templates/warning.yaml"]
        return yaml.safe_load(run(argv + [a for s in sets for a in ("--set", s)]).stdout)["data"]["text"]

    claim = "modelCache.volume=persistentVolumeClaim"
    assert "the model cache claim is ReadWriteOnce, and all 4 pods mount it" in warning(claim)
    assert warning(claim, "modelCache.accessModes={ReadWriteMany}") == ""
    assert warning(claim, "modelCache.existingClaim=shared") == ""  # its access modes are not ours to know
    assert warning() == ""  # emptyDir, the default
    assert "all 6 pods" in warning(claim, "workers.decode.replicas=3")


def test_models_are_pulled_where_a_model_runs_and_not_on_store_pods(rendered):
    """Every pod pulled serve.model, store pods too, which never load it: minutes of start and a
    cache's worth of disk for nothing (and, with the model given as a path, a crash loop)."""
    name, docs = rendered
    values = effective_values(name)
    wanted = values["serve"]["model"] if values["modelCache"]["pullAtStart"] else ""
    for group, template in pod_templates(one(docs, "RayCluster")):
        env = {e["name"]: e.get("value") for e in template["spec"]["containers"][0]["env"]}
        assert env["OASISKV_MODELS"] == ("" if group == "store" else wanted), (name, group)


def test_worker_startup_probes_wait_out_the_model_pull():
    """The worker pods' startup probe allowed a fixed 900 s while the head's followed
    modelCache.pullSeconds: raised for a large model, prefill and decode pods were killed in the
    middle of their first pull, over and over. Store pods pull nothing."""
    for pull in (600, 1800, 0):
        docs = [d for d in yaml.safe_load_all(
            helm_template(None, "--set", f"modelCache.pullSeconds={pull}").stdout) if d]
        for group, template in pod_templates(one(docs, "RayCluster")):
            if group == "head":
                continue
            probe = template["spec"]["containers"][0]["startupProbe"]
            allowed = probe["periodSeconds"] * probe["failureThreshold"]
            wanted = (0 if group == "store" else pull) + 300
            assert wanted <= allowed < wanted + probe["periodSeconds"], (pull, group, allowed)


def test_requests_above_limits_are_refused_naming_the_group():
    """Helm merges resources key by key: a user who set only workers.store.resources.limits.memory
    (6.5Gi) kept the default 8Gi request, and the API server rejected every pod KubeRay made for
    the group, so the RayCluster never came up. Rendering now fails instead."""
    def render(*sets: str):
        return helm_template(None, *[arg for s in sets for arg in ("--set", s)], check=False)

    for refused, message in (
        (["workers.store.resources.limits.memory=6.5Gi"],
         "workers.store: resources.requests.memory (8Gi) is more than resources.limits.memory (6.5Gi)"),
        (["head.resources.limits.cpu=1500m"], "head: resources.requests.cpu (2) is more than resources.limits.cpu (1500m)"),
        (["workers.decode.resources.requests.cpu=4.5"], "workers.decode: resources.requests.cpu (4.5)"),
        (["workers.prefill.resources.requests.memory=9G"], "workers.prefill: resources.requests.memory (9G)"),
        (["workers.prefill.resources.limits.memory=8000Mi"], "resources.limits.memory (8000Mi)"),
    ):
        result = render(*refused)
        assert result.returncode != 0 and message in result.stderr, (refused, result.stderr)
    for accepted in (["workers.store.resources.limits.memory=6.5Gi", "workers.store.resources.requests.memory=6Gi"],
                     ["workers.decode.resources.requests.cpu=4000m"],  # equal is allowed
                     ["head.resources.limits.memory=8192Mi"],
                     ["workers.prefill.resources.requests.memory=8589934592"],  # 8Gi in bytes
                     ["workers.prefill.resources.requests.cpu=500m", "workers.prefill.resources.limits.cpu=1"]):
        result = render(*accepted)
        assert result.returncode == 0, (accepted, result.stderr)


def test_kuberay_and_the_shell_both_read_every_groups_ray_resources(rendered):
    """KubeRay >= 1.3 parses rayStartParams.resources itself (pod.go getResourcesMap:
    strings.Trim(value, "'\\"` ") then json.Unmarshal) before adding --num-gpus from the GPU limit.
    The chart's "{\\"oasiskv_prefill\\": 1}" kept its backslashes after the trim: the parse failed,
    --num-gpus was skipped and the operator logged the error every reconcile. Both readers are
    emulated here: KubeRay's trim and JSON parse, and the shell that runs the `ray start` KubeRay
    builds (` --resources=VALUE `, through the entrypoint's `bash -c`)."""
    name, docs = rendered
    values = effective_values(name)
    for group in one(docs, "RayCluster")["spec"]["workerGroupSpecs"]:
        role, value = group["groupName"], group["rayStartParams"]["resources"]
        wanted = {f"oasiskv_{role}": values["workers"][role]["rayResourceUnits"]}
        assert json.loads(value.strip("'\"` ")) == wanted, (name, role, value)
        argv = run(["bash", "-c", f"printf '%s\\n' --resources={value}"]).stdout.splitlines()
        assert len(argv) == 1 and json.loads(argv[0].removeprefix("--resources=")) == wanted, (name, role, argv)


class _FakeAPI(http.server.BaseHTTPRequestHandler):
    """Stands in, as an HTTP proxy, for the API Service the `helm test` pod calls: the pod's own
    script then runs unchanged, its Service URL reaching this server through http_proxy."""
    model_id = "smollm2-135m"

    def do_GET(self):  # noqa: N802
        # a proxy receives the absolute URL: http://oasis-oasiskv-api:8000/v1/models
        body = {"/health": {"status": "ok"},
                "/v1/models": {"object": "list", "data": [{"id": self.model_id, "object": "model"}]}}.get(
                    "/" + self.path.split("/", 3)[-1])
        self.send_response(200 if body else 404)
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())

    def log_message(self, *args):
        pass


def run_helm_test_pod(pod: dict, model_id: str) -> subprocess.CompletedProcess:
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    _FakeAPI.model_id = model_id
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeAPI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert container["command"][0] == "python"
        return subprocess.run([sys.executable, *container["command"][1:]], capture_output=True, text=True, timeout=30,
                              env={"PATH": os.environ["PATH"], "http_proxy": f"http://127.0.0.1:{server.server_address[1]}",
                                   **env})
    finally:
        server.shutdown()
        server.server_close()


def test_the_helm_test_pod_accepts_the_served_model_name():
    """The `helm test` pod asserted that /v1/models lists serve.model, but the API lists
    --served-model-name when serve.extraArgs gives one: `helm test` failed on a healthy release.
    The pod's own script is run here against a stand-in API."""
    for extra, listed in (("[]", "smollm2-135m"),
                          ('["--served-model-name", "chat", "--store-ttl-s", 300]', "chat"),
                          ('["--served-model-name=chat"]', "chat")):
        docs = [d for d in yaml.safe_load_all(helm_template(None, "--set-json", f"serve.extraArgs={extra}").stdout) if d]
        pod = next(d for d in docs if d["kind"] == "Pod" and d["metadata"]["name"].endswith("-test-api"))
        result = run_helm_test_pod(pod, listed)
        assert result.returncode == 0 and result.stdout.strip() == "ok", (extra, result.stdout, result.stderr)
        # and it still fails when the API lists another model
        assert run_helm_test_pod(pod, "another-model").returncode != 0, extra


def render_notes(tmp_path: Path, values: Path | None, *sets: str) -> str:
    """NOTES.txt as `helm install` prints it: `helm template` leaves NOTES out, so a copy of the
    chart renders the file itself (tpl, with the release's values) into a ConfigMap."""
    chart = tmp_path / "oasiskv"
    if not chart.exists():
        shutil.copytree(CHART, chart, symlinks=False)
        shutil.copy(chart / "templates" / "NOTES.txt", chart / "notes-source.txt")
        (chart / "templates" / "notes.yaml").write_text(
            'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n'
            'data: {text: {{ tpl (.Files.Get "notes-source.txt") . | quote }}}\n')
    argv = [require_tool("helm"), "template", "oasis", str(chart), "--namespace", "llm",
            "--show-only", "templates/notes.yaml"]
    if values is not None:
        argv += ["--values", str(values)]
    return yaml.safe_load(run(argv + [a for s in sets for a in ("--set", s)]).stdout)["data"]["text"]


def test_notes_curl_sends_the_api_key_read_from_its_secret(tmp_path):
    """With an API key NOTES told users to `curl /v1/models` without an Authorization header: a
    401 as their first contact. The commands NOTES prints are run here, kubectl and curl stubbed
    (kubectl answers from the Secret the chart renders; curl prints its arguments)."""
    values = VALUE_SETS["cpu-demo"]
    docs = [d for d in yaml.safe_load_all(helm_template(values).stdout) if d]
    (secret,) = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-api-key")]
    (key,) = secret["data"]
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "kubectl").write_text(
        '#!/bin/sh\n'
        f'[ "$*" = "-n llm get secret {secret["metadata"]["name"]} -o jsonpath={{.data.{key}}}" ] || exit 3\n'
        f'printf %s {secret["data"][key]}\n')
    (stubs / "curl").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)

    def curl_argv(notes: str) -> list[str]:
        lines = [line.strip() for line in notes.splitlines()
                 if line.strip().startswith(("export OASISKV_API_KEY=", "curl "))]
        result = run(["bash", "-ec", "\n".join(lines)], env={"PATH": f"{stubs}:{os.environ['PATH']}"})
        return result.stdout.splitlines()

    notes = render_notes(tmp_path / "chart", values)
    assert curl_argv(notes) == ["-H", "Authorization: Bearer demo-key", "http://127.0.0.1:8000/v1/models"]
    # without a key: no header, and no Secret to read
    notes = render_notes(tmp_path / "chart", None)
    assert "OASISKV_API_KEY" not in notes
    assert curl_argv(notes) == ["http://127.0.0.1:8000/v1/models"]


def test_vllm_prefill_on_the_cuda_image_is_refused():
    """The vLLM connector reads only vLLM's CPU KV cache and refuses a CUDA one when the prefill
    worker starts (oasiskv/prefill_node/vllm_connector.py): serve.prefillEngine=vllm with the CUDA
    image rendered, and its prefill workers could never start."""
    gpu_values = VALUE_SETS["gpu-cluster"]
    for values, sets in ((gpu_values, ["serve.prefillEngine=vllm"]),
                         (gpu_values, ["serve.prefillEngine=vllm", "serve.device=cpu"]),  # still the CUDA build of vLLM
                         (None, ["serve.prefillEngine=vllm", "image.device=cuda", "serve.device=cpu"])):
        result = helm_template(values, *[a for s in sets for a in ("--set", s)], check=False)
        assert result.returncode != 0 and "serve.prefillEngine=vllm needs the CPU image" in result.stderr, (sets, result.stderr)
    assert helm_template(gpu_values, "--set", "serve.prefillEngine=oasiskv").returncode == 0
    assert helm_template(None, "--set", "serve.prefillEngine=vllm").returncode == 0


def test_only_store_pods_turn_off_rays_memory_monitor(rendered):
    """It kills a worker when its node passes 95% of its memory, which a store pod's prefaulted
    arenas fill by design: the store would restart empty, its requests' KV lost."""
    name, docs = rendered
    cluster = one(docs, "RayCluster")
    pods = {g["groupName"]: g["template"] for g in cluster["spec"]["workerGroupSpecs"]}
    pods["head"] = cluster["spec"]["headGroupSpec"]["template"]
    for group, pod in pods.items():
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env.get("RAY_memory_monitor_refresh_ms") == ("0" if group == "store" else None), (name, group)
