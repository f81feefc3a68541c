{{/* Names, labels and images shared by every template. */}}

{{- define "guard.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* <fullname>-<component>, e.g. guard-agent */}}
{{- define "guard.component" -}}
{{- printf "%s-%s" (include "guard.fullname" .root) .name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "guard.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: guard
{{ include "guard.selectorLabels" . }}
{{- end -}}

{{- define "guard.selectorLabels" -}}
app.kubernetes.io/name: guard-{{ .name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .name }}
{{- end -}}

{{/* an image of images.<role>: repository:tag, the tag defaulting to the appVersion */}}
{{- define "guard.image" -}}
{{- $image := index .root.Values.images .role -}}
{{- printf "%s:%s" $image.repository (default .root.Chart.AppVersion $image.tag) -}}
{{- end -}}

{{- define "guard.secretName" -}}
{{- default (printf "%s-secrets" (include "guard.fullname" .)) .Values.secrets.existingSecret -}}
{{- end -}}

{{- define "guard.orchestratorServiceAccount" -}}
{{- default (printf "%s-orchestrator" (include "guard.fullname" .)) .Values.serviceAccount.orchestrator.name -}}
{{- end -}}

{{/* guard.toml: the values' config, and what the chart owns written over it */}}
{{- define "guard.config" -}}
{{- $config := deepCopy .Values.config -}}
{{- $owned := dict
  "home" "/var/lib/guard"
  "streams" (dict "web_port" (int .Values.ports.streams))
  "metrics" (dict "host" "0.0.0.0" "agent_port" (int .Values.ports.agent) "sink_port" (int .Values.ports.sink) "orchestrator_port" (int .Values.ports.orchestrator))
  "orchestrator" (dict "kube_namespace" .Release.Namespace "kube_sweep_image" (include "guard.image" (dict "root" . "role" "sweep")))
-}}
{{- $merged := mustMergeOverwrite $config $owned -}}
{{- include "guard.wholeNumbers" $merged -}}
{{- toToml $merged -}}
{{- end -}}

{{/* YAML numbers reach templates as floats (12 -> 12.0): a whole one goes to guard.toml as an
integer, which Guard reads for an integer and a float setting alike. In place, recursively. */}}
{{- define "guard.wholeNumbers" -}}
{{- range $key, $value := . -}}
{{- if kindIs "map" $value -}}
{{- include "guard.wholeNumbers" $value -}}
{{- else if kindIs "slice" $value -}}
{{- range $value }}{{ if kindIs "map" . }}{{ include "guard.wholeNumbers" . }}{{ end }}{{ end -}}
{{- else if and (kindIs "float64" $value) (eq $value (floor $value)) -}}
{{- $_ := set $ $key (int64 $value) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A service's environment: its config file, and those of the Secret's keys it uses
(optional): every service Kafka's SASL login, the sink and the orchestrator the ClickHouse DSN,
the orchestrator the webhook secret. Called with (dict "root" $ "name" SERVICE). */}}
{{- define "guard.env" -}}
- name: GUARD_CONFIG
  value: /etc/guard/guard.toml
{{- $secret := include "guard.secretName" .root }}
{{- $keys := dict "GUARD_KAFKA_SASL_USERNAME" "kafka-sasl-username" "GUARD_KAFKA_SASL_PASSWORD" "kafka-sasl-password" }}
{{- if has .name (list "sink" "orchestrator") }}
{{- $_ := set $keys "GUARD_CLICKHOUSE_DSN" "clickhouse-dsn" }}
{{- end }}
{{- if eq .name "orchestrator" }}
{{- $_ := set $keys "GUARD_ORCHESTRATOR_WEBHOOK_SECRET" "webhook-secret" }}
{{- end }}
{{- range $name, $key := $keys }}
- name: {{ $name }}
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ $key }}
      optional: true
{{- end }}
{{- end -}}

{{/* readiness and liveness on /healthz of the named port "metrics" */}}
{{- define "guard.probes" -}}
readinessProbe:
  httpGet:
    path: /healthz
    port: metrics
{{ toYaml .Values.probes.readiness | indent 2 }}
livenessProbe:
  httpGet:
    path: /healthz
    port: metrics
{{ toYaml .Values.probes.liveness | indent 2 }}
{{- end -}}

{{/* Guard's taint, tolerated by the agent (and the sweep Jobs, which Guard writes itself) */}}
{{- define "guard.taintKey" -}}
{{- dig "orchestrator" "kube_taint_key" "guard.io/suspect" .Values.config -}}
{{- end -}}
