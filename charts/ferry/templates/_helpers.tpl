{{- define "ferry.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ferry.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "ferry.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ferry.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "ferry.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "ferry.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The label selector the pods are found by, for --bootstrap-kubernetes. */}}
{{- define "ferry.selector" -}}
app.kubernetes.io/name={{ include "ferry.name" . }},app.kubernetes.io/instance={{ .Release.Name }}
{{- end }}

{{- define "ferry.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ferry.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "ferry.secretName" -}}
{{- default (printf "%s-cluster-secret" (include "ferry.fullname" .)) .Values.clusterSecret.existingSecret }}
{{- end }}

{{- define "ferry.image" -}}
{{ .Values.image.repository }}:{{ default .Chart.AppVersion .Values.image.tag }}
{{- end }}
