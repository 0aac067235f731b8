#!/usr/bin/env bash
# Entrypoint of the OasisKV image. The first argument names the role:
#
#   head [serve args]     Ray head + the OpenAI-compatible API (`oasiskv serve --address auto`)
#   worker ROLE [args]    a Ray worker node offering the custom resource oasiskv_ROLE
#                         (prefill | decode | store), joining $RAY_HEAD_ADDRESS
#   kuberay               a KubeRay worker: runs the `ray start` the operator generated
#   kvstore [args]        a standalone KV store (`oasiskv kvstore`)
#   anything else         run as given
#
# Environment: OASISKV_MODELS (models to pull before starting, space-separated; paths are
# checked, not pulled; empty where no model runs, as on store nodes),
# RAY_HEAD_ADDRESS (host:port, workers), OASISKV_ROLE_SLOTS (resource units a worker offers).
# `oasiskv serve` reads OASISKV_API_KEY itself: passing it on as --api-key would show the key
# in every process listing.
set -euo pipefail

readonly state_file=${OASISKV_STATE_FILE:-/tmp/oasiskv-role}
readonly ray_port=${RAY_PORT:-6379}
readonly ray_metrics_port=${RAY_METRICS_PORT:-8080}

log() { echo "oasiskv-entrypoint: $*" >&2; }

# Ray opens a socket per worker process and object transfer; the default 1024 runs out.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

# The health check runs in a separate process that cannot see this script's variables.
remember_role() { printf '%s\n' "$*" >"$state_file"; }

# `oasiskv serve --model` takes a registry name, a Hugging Face directory or a .gguf file, and
# tells them apart as it does (oasiskv/models/pull.py resolve_model): a directory, a name with a
# slash or a .gguf name is a path. Only registry names can be pulled; a path comes from a volume
# mounted into the container, and `oasiskv models pull` refused it, which under `set -e`
# crash-looped every pod. A path that is not there fails here, naming it, rather than later
# inside a Ray actor.
is_model_path() {
    local lower=${1,,}
    [[ -d $1 || $1 == */* || $lower == *.gguf || -e $1 ]]
}

pull_models() {
    local model
    for model in ${OASISKV_MODELS:-}; do
        if is_model_path "$model"; then
            if [[ -e $model ]]; then
                log "model $model is a path in this container (a Hugging Face directory or a .gguf file): nothing to pull"
                continue
            fi
            log "model $model is a path (a Hugging Face directory or a .gguf file) that does not exist in this container: mount it there (a volume), or give a registry name (\`oasiskv models list\`)"
            exit 1
        fi
        log "pulling model $model into ${OASISKV_CACHE:-~/.cache/oasiskv}"
        oasiskv models pull "$model"
    done
}

# Workers may start before the head; `ray start --address` gives up too early on its own.
wait_for_tcp() {  # host port timeout_s
    local deadline=$((SECONDS + $3))
    until timeout 1 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null; do
        ((SECONDS < deadline)) || { log "no answer from $1:$2 after $3 s"; return 1; }
        sleep 1
    done
}

run_head() {
    local port=${OASISKV_PORT:-8000}
    remember_role api "$port"
    pull_models
    ray start --head --port="$ray_port" --include-dashboard=false \
        --metrics-export-port="$ray_metrics_port" --disable-usage-stats ${RAY_HEAD_ARGS:-}
    exec oasiskv serve --address auto --host 0.0.0.0 --port "$port" "$@"
}

run_worker() {
    local role=${1:?worker needs a role: prefill, decode or store}
    shift
    case "$role" in prefill | decode | store) ;; *) log "unknown worker role '$role'"; exit 2 ;; esac
    local head=${RAY_HEAD_ADDRESS:?set RAY_HEAD_ADDRESS to the Ray head (host:port)}
    remember_role worker "$role" "$head"
    pull_models
    wait_for_tcp "${head%:*}" "${head##*:}" "${RAY_HEAD_WAIT_S:-600}"
    exec ray start --address="$head" --block --disable-usage-stats \
        --metrics-export-port="$ray_metrics_port" \
        --resources="{\"oasiskv_$role\": ${OASISKV_ROLE_SLOTS:-1}}" "$@"
}

run_kuberay_worker() {
    local command=${KUBERAY_GEN_RAY_START_CMD:?not started by the KubeRay operator}
    local head
    head=$(grep -o -- '--address=[^ ]*' <<<"$command" | head -1 | cut -d= -f2)
    remember_role worker "${OASISKV_ROLE:-kuberay}" "$head"
    pull_models
    # A shell, not word splitting: the generated command quotes its JSON --resources argument.
    exec bash -c "$command"
}

run_kvstore() {
    local port=${OASISKV_KVSTORE_PORT:-7300}
    remember_role kvstore "$port"
    exec oasiskv kvstore --host 0.0.0.0 --port "$port" "$@"
}

role=${1:-head}
[ $# -gt 0 ] && shift
case "$role" in
    head) run_head "$@" ;;
    worker) run_worker "$@" ;;
    kuberay) run_kuberay_worker ;;
    kvstore) run_kvstore "$@" ;;
    *) remember_role other; exec "$role" "$@" ;;
esac
