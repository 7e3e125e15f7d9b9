{{/*
stalwart.clusterSpec: a RayCluster's spec (a RayJob's rayClusterSpec): the head, the enabled
worker groups (sorted by name), GCS fault tolerance, the autoscaler.
*/}}
{{- define "stalwart.clusterSpec" -}}
{{- $root := . }}
{{- $capacity := 0 }}
{{- $known := true }}
rayVersion: {{ .Values.rayVersion | quote }}
{{- if .Values.autoscaling.enabled }}
enableInTreeAutoscaling: true
autoscalerOptions:
  upscalingMode: {{ .Values.autoscaling.upscalingMode }}
  idleTimeoutSeconds: {{ int .Values.autoscaling.idleTimeoutSeconds }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  {{- with .Values.autoscaling.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- with .Values.gcsFaultTolerance }}
{{- if .enabled }}
gcsFaultToleranceOptions:
  redisAddress: {{ required "gcsFaultTolerance.redisAddress: the external Redis (HOST:PORT, or redis:// / rediss:// URL) is required when gcsFaultTolerance.enabled" .redisAddress | quote }}
  {{- with .redisPassword }}
  {{- if .secretName }}
  redisPassword:
    valueFrom:
      secretKeyRef:
        name: {{ .secretName }}
        key: {{ .secretKey | default "password" }}
  {{- end }}
  {{- end }}
  {{- with .externalStorageNamespace }}
  externalStorageNamespace: {{ . | quote }}
  {{- end }}
{{- end }}
{{- end }}
headGroupSpec:
  {{- $headParams := default (dict) .Values.head.rayStartParams }}
  rayStartParams:
    {{- range $k, $v := $headParams }}
    {{ $k }}: {{ include "stalwart.str" $v | quote }}
    {{- end }}
    {{- if not (hasKey $headParams "dashboard-host") }}
    dashboard-host: "0.0.0.0"
    {{- end }}
  {{- with .Values.head.serviceType }}
  serviceType: {{ . }}
  {{- end }}
  template:
    {{- include "stalwart.pod" (dict "root" $root "g" .Values.head "kind" "head" "where" "head") | trim | nindent 4 }}
  {{- $headRanks := int (include "stalwart.group.ranks" (dict "root" $root "g" .Values.head "where" "head")) }}
  {{- if lt $headRanks 0 }}{{ $known = false }}{{ else }}{{ $capacity = add $capacity $headRanks }}{{ end }}
{{- $groups := list }}
{{- range $name, $g := .Values.workerGroups }}
{{- if and $g (not $g.disabled) }}
{{- $groups = append $groups $name }}
{{- end }}
{{- end }}
{{- if $groups }}
workerGroupSpecs:
{{- range $name := $groups }}
{{- $g := get $root.Values.workerGroups $name }}
{{- $where := printf "workerGroups.%s" $name }}
{{- $replicas := int (dig "replicas" 1 $g) }}
{{- $min := int (dig "minReplicas" $replicas $g) }}
{{- $max := int (dig "maxReplicas" $replicas $g) }}
{{- if or (gt $min $replicas) (gt $replicas $max) }}
{{- fail (printf "%s: needs minReplicas <= replicas <= maxReplicas, got %d, %d, %d" $where $min $replicas $max) }}
{{- end }}
{{- $ranks := int (include "stalwart.group.ranks" (dict "root" $root "g" $g "where" $where)) }}
{{- if lt $ranks 0 }}{{ $known = false }}{{ else }}{{ $capacity = add $capacity (mul $ranks (ternary $max $replicas $root.Values.autoscaling.enabled)) }}{{ end }}
  - groupName: {{ $name }}
    replicas: {{ $replicas }}
    minReplicas: {{ $min }}
    maxReplicas: {{ $max }}
    {{- if $g.rayStartParams }}
    rayStartParams:
      {{- range $k, $v := $g.rayStartParams }}
      {{ $k }}: {{ include "stalwart.str" $v | quote }}
      {{- end }}
    {{- else }}
    rayStartParams: {}
    {{- end }}
    template:
      {{- include "stalwart.pod" (dict "root" $root "g" $g "kind" "worker" "where" $where) | trim | nindent 6 }}
{{- end }}
{{- end }}
{{- with .Values.job }}
{{- $want := .workers }}
{{- if kindIs "map" .workers }}{{ $want = dig "max" 0 .workers }}{{ end }}
{{- $want = int $want }}
{{- if and $known (lt $capacity $want) }}
{{- fail (printf "the cluster holds %d ranks (each enabled group's pods x the ranks a pod holds: its GPUs or CPUs over job.resources, or ranksPerPod), but job.workers asks for %d: add replicas or resources to workerGroups" $capacity $want) }}
{{- end }}
{{- end }}
{{- end }}
