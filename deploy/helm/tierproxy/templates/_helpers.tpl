{{- define "tierproxy.fullname" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tierproxy.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tierproxy.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The engines' stable names through their headless Service: <sts>-<i>.<svc>:8000. */}}
{{- define "tierproxy.backends" -}}
{{- $name := printf "%s-engine" (include "tierproxy.fullname" .) -}}
{{- $backends := list -}}
{{- range $i := until (int .Values.engines.replicas) -}}
{{- $url := printf "http://%s-%d.%s.%s.svc:8000" $name $i $name $.Release.Namespace -}}
{{- $backends = append $backends (dict "url" $url "max_inflight" (int $.Values.engines.maxInflight)) -}}
{{- end -}}
{{- toYaml $backends -}}
{{- end -}}

{{/* The proxy's config: the values' `config`, its backends and shared state filled in. */}}
{{- define "tierproxy.config" -}}
{{- $config := deepCopy .Values.config -}}
{{- if and .Values.engines.enabled (not (hasKey $config "backends")) -}}
{{- $_ := set $config "backends" (include "tierproxy.backends" . | fromYamlArray) -}}
{{- end -}}
{{- if and .Values.redis.enabled (not (hasKey $config "shared_state")) -}}
{{- $url := printf "redis://%s-redis:6379/0" (include "tierproxy.fullname" .) -}}
{{- $_ := set $config "shared_state" (dict "url" $url "on_failure" "local") -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}
