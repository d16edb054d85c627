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
{{- end }}
