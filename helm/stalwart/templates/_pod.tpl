{{/*
stalwart.pod: a head's or a worker group's pod template. Called with
(dict "root" $ "g" GROUP "kind" "head"|"worker" "where" "head"|"workerGroups.NAME").
The Ray container comes first (KubeRay's rule). The head also runs the job's driver and its
supervisor, hence the exporter's port and the job spec's volume.
*/}}
{{- define "stalwart.pod" -}}
{{- $root := .root }}
{{- $g := .g }}
{{- $head := eq .kind "head" }}
{{- $shm := include "stalwart.group.shm" . }}
{{- $own := dict "shm" "/dev/shm" "ray-logs" "/tmp/ray" "job-spec" "/etc/stalwart" }}
{{- range $i, $v := $g.volumes }}
{{- if hasKey $own $v.name }}
{{- fail (printf "%s.volumes.%d: %q is the chart's own volume (at %s): give yours another name" $.where $i $v.name (get $own $v.name)) }}
{{- end }}
{{- end }}
{{- range $i, $m := $g.volumeMounts }}
{{- if has $m.mountPath (values $own) }}
{{- fail (printf "%s.volumeMounts.%d: the chart mounts its own volume at %s" $.where $i $m.mountPath) }}
{{- end }}
{{- end }}
metadata:
  labels:
    {{- include "stalwart.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .kind }}
    {{- with $g.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- $annotations := deepCopy (default (dict) $g.annotations) }}
  {{- if and $head $root.Values.job }}
  {{- $_ := set $annotations "stalwart.io/job-spec-sha256" (include "stalwart.jobText" $root | sha256sum) }}
  {{- end }}
  {{- with $annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  serviceAccountName: {{ include "stalwart.serviceAccountName" $root }}
  automountServiceAccountToken: {{ $root.Values.serviceAccount.automountServiceAccountToken }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $root.Values.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  terminationGracePeriodSeconds: {{ int (dig "terminationGracePeriodSeconds" 60 $g) }}
  {{- with $g.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $g.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ ternary "ray-head" "ray-worker" $head }}
      image: {{ include "stalwart.image" $root | quote }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      {{- with $root.Values.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $head }}
      ports:
        - {name: gcs-server, containerPort: 6379, protocol: TCP}
        - {name: dashboard, containerPort: 8265, protocol: TCP}
        - {name: client, containerPort: 10001, protocol: TCP}
        - {name: metrics, containerPort: 8080, protocol: TCP}
        - {name: exporter, containerPort: {{ include "stalwart.exporterPort" $root }}, protocol: TCP}
      {{- end }}
      {{- with $g.env }}
      env:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $g.envFrom }}
      envFrom:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- $res := default (dict) $g.resources }}
      {{- $limits := dict }}
      {{- with $res.cpu }}{{ $_ := set $limits "cpu" (include "stalwart.str" .) }}{{ end }}
      {{- with $res.memory }}{{ $_ := set $limits "memory" (include "stalwart.str" .) }}{{ end }}
      {{- $requests := deepCopy $limits }}
      {{- with $res.gpu }}{{ $_ := set $limits $root.Values.gpuResourceName (int .) }}{{ end }}
      {{- with $limits }}
      resources:
        limits:
          {{- toYaml $limits | nindent 10 }}
        {{- with $requests }}
        requests:
          {{- toYaml . | nindent 10 }}
        {{- end }}
      {{- end }}
      volumeMounts:
        - {name: shm, mountPath: /dev/shm}
        - {name: ray-logs, mountPath: /tmp/ray}
        {{- if and $head $root.Values.job }}
        - {name: job-spec, mountPath: /etc/stalwart, readOnly: true}
        {{- end }}
        {{- with $g.volumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: shm
      emptyDir:
        medium: Memory
        {{- with $shm }}
        sizeLimit: {{ . }}
        {{- end }}
    - name: ray-logs
      emptyDir: {}
    {{- if and $head $root.Values.job }}
    - name: job-spec
      configMap:
        name: {{ include "stalwart.fullname" $root }}-job
    {{- end }}
    {{- with $g.volumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}
