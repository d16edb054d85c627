{{/*
Chart name, overridable by nameOverride.
*/}}
{{- define "cubelet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name, at most 63 characters (DNS label limit).
*/}}
{{- define "cubelet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Chart name and version, for the helm.sh/chart label.
*/}}
{{- define "cubelet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Common labels.
*/}}
{{- define "cubelet.labels" -}}
helm.sh/chart: {{ include "cubelet.chart" . }}
{{ include "cubelet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Labels naming the release, on every object. Not a selector on their own:
the test Pod and the uninstall Job pods carry them too.
*/}}
{{- define "cubelet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cubelet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Selector of the installer pods (DaemonSet and Service): the release labels
plus the installer component, which no other pod of the chart has (the test
Pod is component "test", the uninstall Jobs' pods "uninstall"). Immutable on
the DaemonSet: changing it needs the DaemonSet deleted first (README).
*/}}
{{- define "cubelet.installerSelectorLabels" -}}
{{ include "cubelet.selectorLabels" . }}
app.kubernetes.io/component: installer
{{- end }}

{{/*
Namespace of the chart's objects: namespace.name, else the release
namespace. `default dict` keeps `helm upgrade --reuse-values` from an older
chart (whose values lack `namespace`) working.
*/}}
{{- define "cubelet.namespace" -}}
{{- (.Values.namespace | default dict).name | default .Release.Namespace }}
{{- end }}

{{/*
ServiceAccount name.
*/}}
{{- define "cubelet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "cubelet.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Installer image reference; the tag defaults to the chart's appVersion.
*/}}
{{- define "cubelet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
Port of config.metrics.address ("host:port" or "[v6]:port").
*/}}
{{- define "cubelet.metricsPort" -}}
{{- splitList ":" .Values.config.metrics.address | last }}
{{- end }}

{{/*
Host of config.metrics.address as seen from the node itself: a wildcard
address is reached through loopback.
*/}}
{{- define "cubelet.metricsHost" -}}
{{- $host := trimSuffix (printf ":%s" (include "cubelet.metricsPort" .)) .Values.config.metrics.address }}
{{- if or (eq $host "") (eq $host "0.0.0.0") }}127.0.0.1
{{- else if eq $host "[::]" }}[::1]
{{- else }}{{ $host }}
{{- end }}
{{- end }}

{{/*
True ("true") when metrics only listen on loopback, so nothing off-node can
scrape them.
*/}}
{{- define "cubelet.metricsLoopback" -}}
{{- $host := trimSuffix (printf ":%s" (include "cubelet.metricsPort" .)) .Values.config.metrics.address }}
{{- if or (hasPrefix "127." $host) (eq $host "[::1]") (eq $host "localhost") }}true{{ end }}
{{- end }}

{{/*
The /readyz URL probed from the node's network namespace.
*/}}
{{- define "cubelet.readyzURL" -}}
{{- printf "http://%s:%s/readyz" (include "cubelet.metricsHost" .) (include "cubelet.metricsPort" .) }}
{{- end }}

{{/*
Path of the kubelet drop-in written when kubelet.switchRuntime is true.
*/}}
{{- define "cubelet.kubeletDropIn" -}}
{{- printf "%s/%s.service.d/%s" .Values.install.systemdDir .Values.kubelet.serviceName .Values.kubelet.dropInFile }}
{{- end }}

{{/*
Environment shared by the installer DaemonSet and the uninstall Jobs.
*/}}
{{- define "cubelet.installerEnv" -}}
- name: HOST_ROOT
  value: /host
- name: CUBELET_IMAGE_BIN_DIR
  value: {{ .Values.image.binDir | quote }}
- name: CUBELET_BIN_DIR
  value: {{ .Values.install.binDir | quote }}
- name: CUBELET_CONFIG_DIR
  value: {{ .Values.install.configDir | quote }}
- name: CUBELET_SYSTEMD_DIR
  value: {{ .Values.install.systemdDir | quote }}
- name: CUBELET_READYZ_URL
  value: {{ include "cubelet.readyzURL" . | quote }}
- name: CUBELET_READY_TIMEOUT
  value: {{ .Values.install.readyTimeoutSeconds | quote }}
- name: KUBELET_SWITCH_RUNTIME
  value: {{ .Values.kubelet.switchRuntime | quote }}
- name: KUBELET_SERVICE
  value: {{ .Values.kubelet.serviceName | quote }}
- name: KUBELET_DROPIN
  value: {{ include "cubelet.kubeletDropIn" . | quote }}
- name: CUBELET_PURGE_STATE
  value: {{ .Values.uninstall.purgeState | quote }}
- name: CUBELET_ROOT_DIR
  value: {{ .Values.config.root_dir | quote }}
- name: CUBELET_STATE_DIR
  value: {{ .Values.config.state_dir | quote }}
- name: CUBELET_SOCKET
  value: {{ .Values.config.socket | quote }}
- name: CUBELET_BRIDGE
  value: {{ if eq (.Values.config.network.provider | toString) "bridge" }}{{ .Values.config.network.bridge.name | quote }}{{ else }}""{{ end }}
- name: POD_UID
  valueFrom:
    fieldRef:
      fieldPath: metadata.uid
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- end }}

{{/*
"true" when the DaemonSet controller runs an installer pod on .node (a Node
object from lookup) under the values of .root, as NodeShouldRunDaemonPod
decides it:
- every nodeSelector label is present on the node with that value (a
  missing label never matches, not even an empty value);
- the node matches the required node affinity;
- every NoSchedule and NoExecute taint of the node is tolerated by
  .Values.tolerations or by the tolerations the DaemonSet controller adds
  to daemon pods (not-ready and unreachable NoExecute; disk-, memory- and
  pid-pressure, unschedulable and, for hostNetwork pods such as these,
  network-unavailable NoSchedule).
The uninstall Jobs go to exactly these nodes.
*/}}
{{- define "cubelet.installerRunsOn" -}}
{{- $values := .root.Values }}
{{- $node := .node }}
{{- $labels := $node.metadata.labels | default dict }}
{{- $ok := true }}
{{- range $key, $want := $values.nodeSelector }}
{{- if not (and (hasKey $labels $key) (eq (toString (get $labels $key)) (toString $want))) }}
{{- $ok = false }}
{{- end }}
{{- end }}
{{- with dig "nodeAffinity" "requiredDuringSchedulingIgnoredDuringExecution" dict ($values.affinity | default dict) }}
{{- $any := false }}
{{- range $term := .nodeSelectorTerms }}
{{- if include "cubelet.nodeSelectorTermMatches" (dict "term" $term "node" $node) }}
{{- $any = true }}
{{- end }}
{{- end }}
{{- if not $any }}
{{- $ok = false }}
{{- end }}
{{- end }}
{{- $tolerations := $values.tolerations | default list }}
{{- range $key := list "not-ready" "unreachable" }}
{{- $tolerations = append $tolerations (dict "key" (printf "node.kubernetes.io/%s" $key) "operator" "Exists" "effect" "NoExecute") }}
{{- end }}
{{- range $key := list "disk-pressure" "memory-pressure" "pid-pressure" "unschedulable" "network-unavailable" }}
{{- $tolerations = append $tolerations (dict "key" (printf "node.kubernetes.io/%s" $key) "operator" "Exists" "effect" "NoSchedule") }}
{{- end }}
{{- range $taint := dig "spec" "taints" list $node }}
{{- if has $taint.effect (list "NoSchedule" "NoExecute") }}
{{- $tolerated := false }}
{{- range $toleration := $tolerations }}
{{- if include "cubelet.tolerates" (dict "toleration" $toleration "taint" $taint) }}
{{- $tolerated = true }}
{{- end }}
{{- end }}
{{- if not $tolerated }}
{{- $ok = false }}
{{- end }}
{{- end }}
{{- end }}
{{- if $ok }}true{{ end }}
{{- end }}

{{/*
"true" when the NodeSelectorTerm .term matches .node: all its
matchExpressions (In, NotIn, Exists, DoesNotExist, Gt, Lt on labels) and
matchFields (metadata.name) hold; an empty term matches nothing.
*/}}
{{- define "cubelet.nodeSelectorTermMatches" -}}
{{- $labels := .node.metadata.labels | default dict }}
{{- $name := .node.metadata.name }}
{{- $exprs := .term.matchExpressions | default list }}
{{- $fields := .term.matchFields | default list }}
{{- $ok := not (and (empty $exprs) (empty $fields)) }}
{{- range $e := $exprs }}
{{- $has := hasKey $labels $e.key }}
{{- $value := toString (get $labels $e.key) }}
{{- $values := $e.values | default list }}
{{- if eq $e.operator "In" }}
{{- if not (and $has (has $value $values)) }}{{ $ok = false }}{{ end }}
{{- else if eq $e.operator "NotIn" }}
{{- if and $has (has $value $values) }}{{ $ok = false }}{{ end }}
{{- else if eq $e.operator "Exists" }}
{{- if not $has }}{{ $ok = false }}{{ end }}
{{- else if eq $e.operator "DoesNotExist" }}
{{- if $has }}{{ $ok = false }}{{ end }}
{{- else if or (eq $e.operator "Gt") (eq $e.operator "Lt") }}
{{- $limit := toString (first $values) }}
{{- if not (and $has (eq (len $values) 1) (regexMatch "^[-+]?[0-9]+$" $value) (regexMatch "^[-+]?[0-9]+$" $limit)) }}
{{- $ok = false }}
{{- else if and (eq $e.operator "Gt") (not (gt (atoi $value) (atoi $limit))) }}
{{- $ok = false }}
{{- else if and (eq $e.operator "Lt") (not (lt (atoi $value) (atoi $limit))) }}
{{- $ok = false }}
{{- end }}
{{- else }}
{{- $ok = false }}
{{- end }}
{{- end }}
{{- range $f := $fields }}
{{- $in := and (eq $f.key "metadata.name") (has $name ($f.values | default list)) }}
{{- if eq $f.operator "In" }}
{{- if not $in }}{{ $ok = false }}{{ end }}
{{- else if eq $f.operator "NotIn" }}
{{- if or $in (ne $f.key "metadata.name") }}{{ $ok = false }}{{ end }}
{{- else }}
{{- $ok = false }}
{{- end }}
{{- end }}
{{- if $ok }}true{{ end }}
{{- end }}

{{/*
"true" when .toleration tolerates .taint (core/v1 ToleratesTaint): an empty
effect or key matches any, operator Exists matches any value, Equal (the
default) needs the same value.
*/}}
{{- define "cubelet.tolerates" -}}
{{- $toleration := .toleration }}
{{- $taint := .taint }}
{{- $operator := $toleration.operator | default "Equal" }}
{{- $effect := or (empty $toleration.effect) (eq (toString $toleration.effect) (toString $taint.effect)) }}
{{- $key := or (empty $toleration.key) (eq (toString $toleration.key) (toString $taint.key)) }}
{{- $value := or (eq $operator "Exists") (and (eq $operator "Equal") (eq (toString ($toleration.value | default "")) (toString ($taint.value | default "")))) }}
{{- if and $effect $key $value }}true{{ end }}
{{- end }}
