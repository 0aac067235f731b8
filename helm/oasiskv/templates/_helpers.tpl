{{/* Names and labels. */}}
{{- define "oasiskv.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-scoped name; KubeRay derives pod and service names from it, so keep it short. */}}
{{- define "oasiskv.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "oasiskv.selectorLabels" -}}
app.kubernetes.io/name: {{ include "oasiskv.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "oasiskv.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "oasiskv.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: oasiskv
{{- end }}

{{- define "oasiskv.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion .Values.image.device) -}}
{{ printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{- define "oasiskv.apiKeySecretName" -}}
{{- .Values.apiKey.existingSecret | default (printf "%s-api-key" (include "oasiskv.fullname" .)) }}
{{- end }}

{{- define "oasiskv.rayAuthSecretName" -}}
{{- .Values.rayAuth.existingSecret | default (printf "%s-ray-auth" (include "oasiskv.fullname" .)) }}
{{- end }}

{{- define "oasiskv.apiKeyEnabled" -}}
{{- if or .Values.apiKey.value .Values.apiKey.existingSecret }}true{{ end }}
{{- end }}

{{/* Workers of a role as `oasiskv serve` counts them: pods x resource units per pod. */}}
{{- define "oasiskv.workerCount" -}}
{{- $group := index .root.Values.workers .role -}}
{{- mul $group.replicas $group.rayResourceUnits -}}
{{- end }}

{{/* Where prefill and decode workers run the model: serve.device, else the image's variant. */}}
{{- define "oasiskv.serveDevice" -}}
{{- $device := .Values.serve.device | default .Values.image.device -}}
{{- if and (eq $device "cuda") (ne .Values.image.device "cuda") -}}
{{- fail "serve.device=cuda needs the CUDA image: set image.device=cuda" -}}
{{- end -}}
{{- $device -}}
{{- end }}

{{/* `oasiskv serve --gpus-per-worker` for device cuda: the smallest share of a GPU a prefill or
     decode worker gets in its pod (gpus / rayResourceUnits), at most one. Ray hides every GPU
     from an actor that asks for none, so a group without GPUs cannot run cuda workers. */}}
{{- define "oasiskv.gpusPerWorker" -}}
{{- $shares := list -}}
{{- range $role := list "prefill" "decode" -}}
{{- $group := index $.Values.workers $role -}}
{{- if lt (int $group.gpus) 1 -}}
{{- fail (printf "serve.device=cuda needs workers.%s.gpus >= 1" $role) -}}
{{- end -}}
{{- $shares = append $shares (divf $group.gpus $group.rayResourceUnits) -}}
{{- end -}}
{{- minf 1 (index $shares 0) (index $shares 1) -}}
{{- end }}

{{/* The rayStartParams `resources` value as KubeRay itself writes it (fmt.Sprintf("'%s'", json)):
     JSON inside single quotes, for the shell KubeRay's `ray start` command runs in. The form with
     escaped double quotes ("{\"oasiskv_prefill\": 1}") also reached Ray, but KubeRay >= 1.3 reads
     the value too (getResourcesMap: strings.Trim(s, "'\"` ") then json.Unmarshal), failed on the
     backslashes left inside, skipped adding --num-gpus and logged an error every reconcile. */}}
{{- define "oasiskv.rayResources" -}}
{{- printf "'{\"oasiskv_%s\": %d}'" .role (int .units) -}}
{{- end }}

{{/* Volumes every Ray pod mounts: shared memory for the object store, the model cache, /tmp. */}}
{{- define "oasiskv.volumes" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.sharedMemory.sizeLimit }}
- name: tmp
  emptyDir: {}
{{- if eq .Values.modelCache.volume "emptyDir" }}
- name: model-cache
  emptyDir:
    sizeLimit: {{ .Values.modelCache.sizeLimit }}
{{- else if eq .Values.modelCache.volume "persistentVolumeClaim" }}
- name: model-cache
  persistentVolumeClaim:
    claimName: {{ .Values.modelCache.existingClaim | default (printf "%s-model-cache" (include "oasiskv.fullname" .)) }}
{{- end }}
{{- end }}

{{- define "oasiskv.volumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
- name: tmp
  mountPath: /tmp
{{- if ne .Values.modelCache.volume "none" }}
- name: model-cache
  mountPath: /var/cache/oasiskv
{{- end }}
{{- end }}

{{/* Environment of every Ray container; called with (dict "root" $ "role" ROLE), ROLE head, prefill,
     decode or store. Store pods never load the model: nothing to pull there (OASISKV_MODELS empty). */}}
{{- define "oasiskv.env" -}}
{{- with .root -}}
- name: OASISKV_CACHE
  value: /var/cache/oasiskv
- name: OASISKV_MODELS
  value: {{ ternary .Values.serve.model "" (and .Values.modelCache.pullAtStart (ne $.role "store")) | quote }}
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
{{- if eq $.role "store" }}
{{- /* Ray's memory monitor kills a worker when its node passes 95% of its memory; a store pod's
     prefaulted arenas fill it by design (checkStoreMemory leaves 1 GiB), and the store killed
     would restart empty, its requests' KV lost. The kernel's limit still holds. */}}
- name: RAY_memory_monitor_refresh_ms
  value: "0"
{{- end }}
- name: RAY_AUTH_MODE
  value: {{ ternary "token" "disabled" .Values.rayAuth.enabled }}
{{- if .Values.rayAuth.enabled }}
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "oasiskv.rayAuthSecretName" . }}
      key: {{ .Values.rayAuth.secretKey }}
{{- end }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}
{{- end }}

{{/* Exec probe of Ray worker pods: a raylet runs and the head's GCS answers. Called with
     (dict "root" $ "role" ROLE). The startup probe allows modelCache.pullSeconds for the first
     pull (and conversion) of the model, as the head's does, plus 300 s for `ray start` to join;
     a fixed 900 s killed prefill and decode pods mid-pull whenever pullSeconds was raised past
     600 for a large model. Store pods pull nothing. */}}
{{- define "oasiskv.workerProbes" -}}
{{- $pullSeconds := ternary 0 (int .root.Values.modelCache.pullSeconds) (eq .role "store") -}}
startupProbe:
  exec:
    command: [python, /opt/oasiskv/healthcheck.py]
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: {{ div (add $pullSeconds 300 9) 10 }}
livenessProbe:
  exec:
    command: [python, /opt/oasiskv/healthcheck.py]
  periodSeconds: 20
  timeoutSeconds: 5
  failureThreshold: 3
readinessProbe:
  exec:
    command: [python, /opt/oasiskv/healthcheck.py]
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 2
{{- end }}

{{/* A Kubernetes quantity as a number: memory in bytes, CPU in cores (milli "m", binary and
     decimal suffixes); empty for a form not parsed here (an exponent, "Pi"), which then goes
     unchecked. */}}
{{- define "oasiskv.quantityBytes" -}}
{{- $text := toString . -}}
{{- $number := regexFind "^[0-9]+(\\.[0-9]*)?" $text -}}
{{- $suffix := trimPrefix $number $text -}}
{{- $scale := dict "" 1.0 "m" 0.001 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "k" 1000.0 "M" 1000000.0 "G" 1000000000.0 "T" 1000000000000.0 -}}
{{- if and $number (hasKey $scale $suffix) -}}
{{- mulf (float64 $number) (get $scale $suffix) -}}
{{- end -}}
{{- end }}

{{/* Each store pod holds rayResourceUnits stores, each an arena of serve.storeCapacityGb GiB in
     the pod's memory: past its limit the kernel kills the pod and every request's KV with it.
     1 GiB is left for Ray and the store processes. */}}
{{- define "oasiskv.checkStoreMemory" -}}
{{- $group := .Values.workers.store -}}
{{- $limit := dig "limits" "memory" "" $group.resources -}}
{{- $limitBytes := include "oasiskv.quantityBytes" $limit -}}
{{- if $limitBytes -}}
{{- $arenas := mulf $group.rayResourceUnits .Values.serve.storeCapacityGb 1073741824.0 -}}
{{- if gt (addf $arenas 1073741824.0) (float64 $limitBytes) -}}
{{- fail (printf "workers.store: %d store(s) per pod x serve.storeCapacityGb %v GiB need %v GiB of the pod's memory plus 1 GiB for Ray, more than workers.store.resources.limits.memory (%v); raise the limit or lower the capacity or rayResourceUnits" (int $group.rayResourceUnits) .Values.serve.storeCapacityGb (divf $arenas 1073741824.0) $limit) -}}
{{- end -}}
{{- end -}}
{{- end }}

{{/* NOTES' warning for a model cache claim every pod mounts but only one node can attach; empty
     otherwise. Not a failure: on a one-node cluster (kind, minikube) ReadWriteOnce serves. */}}
{{- define "oasiskv.modelCacheWarning" -}}
{{- $cache := .Values.modelCache -}}
{{- if and (eq $cache.volume "persistentVolumeClaim") (not $cache.existingClaim) (not (has "ReadWriteMany" $cache.accessModes)) -}}
{{- $pods := add 1 .Values.workers.prefill.replicas .Values.workers.decode.replicas .Values.workers.store.replicas -}}
WARNING: the model cache claim is {{ join ", " $cache.accessModes }}, and all {{ $pods }} pods mount it: they can
only run on the node that attaches it, and pods on other nodes stay Pending. Use
modelCache.accessModes [ReadWriteMany] with a storage class that offers it, or volume: emptyDir.
{{- end -}}
{{- end }}

{{/* Helm merges a user's resources into the defaults key by key, so setting only a limit keeps the
     default request (workers.store.resources.limits.memory 6.5Gi beside the default 8Gi request):
     the API server then rejects every pod KubeRay creates for the group, and the RayCluster never
     comes up. Fail at render time instead, naming the group and both values. */}}
{{- define "oasiskv.checkRequestsWithinLimits" -}}
{{- $groups := list (list "head" .Values.head.resources) -}}
{{- range $role := list "prefill" "decode" "store" -}}
{{- $groups = append $groups (list (printf "workers.%s" $role) (index $.Values.workers $role).resources) -}}
{{- end -}}
{{- range $group := $groups -}}
{{- $name := index $group 0 -}}
{{- $resources := index $group 1 | default dict -}}
{{- range $kind := list "cpu" "memory" -}}
{{- $request := dig "requests" $kind "" $resources -}}
{{- $limit := dig "limits" $kind "" $resources -}}
{{- if and $request $limit -}}
{{- $requestValue := include "oasiskv.quantityBytes" $request -}}
{{- $limitValue := include "oasiskv.quantityBytes" $limit -}}
{{- if and $requestValue $limitValue (gt (float64 $requestValue) (float64 $limitValue)) -}}
{{- fail (printf "%s: resources.requests.%s (%v) is more than resources.limits.%s (%v); Kubernetes rejects such a pod: set both (Helm keeps the default of the one not set)" $name $kind $request $kind $limit) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end }}

{{/* The model id the API lists: `--served-model-name` from serve.extraArgs when given (either
     form; the last wins, as argparse has it), else serve.model. */}}
{{- define "oasiskv.servedModelName" -}}
{{- $served := toString .Values.serve.model -}}
{{- $args := .Values.serve.extraArgs | default list -}}
{{- range $i, $arg := $args -}}
{{- $text := toString $arg -}}
{{- if and (eq $text "--served-model-name") (lt (add1 $i) (len $args)) -}}
{{- $served = toString (index $args (add1 $i)) -}}
{{- else if hasPrefix "--served-model-name=" $text -}}
{{- $served = trimPrefix "--served-model-name=" $text -}}
{{- end -}}
{{- end -}}
{{- $served -}}
{{- end }}

{{/* The vLLM prefill engine's connector (OasisKVConnector) reads only vLLM's CPU KV cache and
     refuses any other when the prefill worker starts (prefill_node/vllm_connector.py
     _require_cpu_cache); the CUDA image's vLLM is the CUDA build, whose cache is on the GPU
     whatever serve.device says. Refused here rather than as prefill workers that never start. */}}
{{- define "oasiskv.checkPrefillEngine" -}}
{{- if and (eq .Values.serve.prefillEngine "vllm") (eq .Values.image.device "cuda") -}}
{{- fail "serve.prefillEngine=vllm needs the CPU image (image.device=cpu, built with VLLM=1): the vLLM connector reads only vLLM's CPU KV cache, and the CUDA image's vLLM keeps it on the GPU, so every prefill worker would fail at start" -}}
{{- end -}}
{{- end }}
