{{/*
Names and labels. The full name is cut to 40 characters: KubeRay derives longer names from it
(a RayJob's cluster adds a suffix, pods add their group and a hash).
*/}}
{{- define "stalwart.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "stalwart.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "stalwart.selectorLabels" -}}
app.kubernetes.io/name: {{ include "stalwart.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "stalwart.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "stalwart.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: stalwart
{{- end }}

{{- define "stalwart.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{- define "stalwart.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "stalwart.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The exporter's port: the job spec's metrics.port in the ConfigMap, the pods' and the
Service's port. */}}
{{- define "stalwart.exporterPort" -}}
{{- int .Values.exporter.port }}
{{- end }}

{{/*
stalwart.jobText: the job spec as the ConfigMap carries it, with metrics.host 0.0.0.0 and
metrics.port exporter.port so that the Service and the PodMonitor reach the exporter (the
supervisor binds 127.0.0.1 and a free port unless told otherwise).
*/}}
{{- define "stalwart.jobText" -}}
{{- $job := deepCopy .Values.job }}
{{- $metrics := dig "metrics" (dict) $job }}
{{- $port := int .Values.exporter.port }}
{{- $given := int (dig "port" 0 $metrics) }}
{{- if and $given (ne $given $port) }}
{{- fail (printf "job.metrics.port (%d) differs from exporter.port (%d): the chart serves the exporter on exporter.port; leave job.metrics.port out or make them equal" $given $port) }}
{{- end }}
{{- $_ := set $metrics "host" "0.0.0.0" }}
{{- $_ := set $metrics "port" $port }}
{{- $_ := set $job "metrics" $metrics }}
{{- include "stalwart.yaml" (dict "v" $job "indent" 0) | trim }}
{{- end }}

{{/*
stalwart.yaml: a mapping as YAML that PyYAML (YAML 1.1, which `stalwart run` reads) reads back
as the same values. Helm's toYaml writes 0.00003 as 3e-05, which YAML 1.1 takes for a string,
and Helm holds every number as a float. Here whole numbers are written as integers, an exponent
always has a decimal point, strings are JSON-quoted; nested mappings in block style, lists in
flow style. Called with (dict "v" MAPPING "indent" N).
*/}}
{{- define "stalwart.yaml" -}}
{{- $pad := repeat (int .indent) " " }}
{{- range $k, $v := .v }}
{{ $pad }}{{ include "stalwart.yaml.key" $k }}:
{{- if and (kindIs "map" $v) $v }}
{{- include "stalwart.yaml" (dict "v" $v "indent" (add $.indent 2)) }}
{{- else }} {{ include "stalwart.yaml.flow" $v }}
{{- end }}
{{- end }}
{{- end }}

{{- define "stalwart.yaml.key" -}}
{{- if and (regexMatch "^[a-z_][a-z0-9_]*$" .) (not (has . (list "y" "n" "yes" "no" "on" "off" "true" "false" "null"))) }}
{{- . }}
{{- else }}
{{- toJson . }}
{{- end }}
{{- end }}

{{- define "stalwart.yaml.flow" -}}
{{- if kindIs "map" . }}
{{- $items := list }}
{{- range $k, $v := . }}
{{- $items = append $items (printf "%s: %s" (toJson $k) (include "stalwart.yaml.flow" $v)) }}
{{- end }}
{{- printf "{%s}" (join ", " $items) }}
{{- else if kindIs "slice" . }}
{{- $items := list }}
{{- range . }}
{{- $items = append $items (include "stalwart.yaml.flow" .) }}
{{- end }}
{{- printf "[%s]" (join ", " $items) }}
{{- else if kindIs "string" . }}
{{- toJson . }}
{{- else if kindIs "invalid" . }}
{{- "null" }}
{{- else if kindIs "float64" . }}
{{- include "stalwart.yaml.number" . }}
{{- else }}
{{- toString . }}
{{- end }}
{{- end }}

{{- define "stalwart.yaml.number" -}}
{{- $s := toString . }}
{{- if and (eq (floor .) .) (lt . 9007199254740992.0) (gt . -9007199254740992.0) }}
{{- printf "%d" (int64 .) }}
{{- else if and (contains "e" $s) (not (contains "." $s)) }}
{{- replace "e" ".0e" $s }}
{{- else }}
{{- $s }}
{{- end }}
{{- end }}

{{/* stalwart.str: a value as text, a number without an exponent where it is whole. */}}
{{- define "stalwart.str" -}}
{{- if kindIs "float64" . }}
{{- include "stalwart.yaml.number" . }}
{{- else }}
{{- toString . }}
{{- end }}
{{- end }}

{{/*
Quantities. stalwart.bytes: a memory quantity ("16Gi", "512M", 1073741824) in bytes;
stalwart.cpus: a CPU quantity ("500m", "2", 4) in CPUs. Both print a number.
Called with (list QUANTITY "where.it.came.from").
*/}}
{{- define "stalwart.bytes" -}}
{{- $q := include "stalwart.str" (index . 0) }}
{{- $m := regexFindAll "^([0-9]+(?:\\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|K|M|G|T|P|E)?$" $q -1 }}
{{- if not $m }}
{{- fail (printf "%s: %q is not a memory quantity (e.g. 16Gi, 512Mi, 1073741824)" (index . 1) $q) }}
{{- end }}
{{- $num := regexFind "^[0-9.]+" $q | float64 }}
{{- $unit := trimPrefix (regexFind "^[0-9.]+" $q) $q }}
{{- $scale := get (dict "" 1.0 "k" 1e3 "K" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0) $unit }}
{{- printf "%d" (int64 (ceil (mulf $num $scale))) }}
{{- end }}

{{- define "stalwart.cpus" -}}
{{- $q := include "stalwart.str" (index . 0) }}
{{- if regexMatch "^[0-9]+m$" $q }}
{{- divf (trimSuffix "m" $q | float64) 1000.0 }}
{{- else if regexMatch "^[0-9]+(\\.[0-9]+)?$" $q }}
{{- float64 $q }}
{{- else }}
{{- fail (printf "%s: %q is not a CPU quantity (e.g. 4, 500m)" (index . 1) $q) }}
{{- end }}
{{- end }}

{{/*
stalwart.entrypoint: the RayJob's command line (Ray runs it through a shell on the head).
Called with (dict "root" $ "runDir" DIR). An argument that is not plain is single-quoted (the
values' schema refuses a quote inside one).
*/}}
{{- define "stalwart.entrypoint" -}}
{{- $args := list "stalwart" "run" "/etc/stalwart/job.yaml" "--run-dir" .runDir "--status-every" "5" "--all-ranks" }}
{{- $args = concat $args (default (list) .root.Values.rayJob.runArgs) }}
{{- $quoted := list }}
{{- range $args }}
{{- $a := toString . }}
{{- $quoted = append $quoted (ternary $a (squote $a) (regexMatch "^[A-Za-z0-9_./=:,@%+~-]+$" $a)) }}
{{- end }}
{{- join " " $quoted }}
{{- end }}
