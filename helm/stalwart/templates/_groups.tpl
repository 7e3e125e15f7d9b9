{{/*
What a group's pods hold: ranks, and the memory-backed /dev/shm sized for them. Each is called
with (dict "root" $ "g" GROUP "where" "workerGroups.NAME").
*/}}

{{/*
stalwart.group.ranks: the ranks one pod of the group holds. ranksPerPod when given; else the
pod's GPUs over the GPUs a rank asks (job.resources.gpu) or its CPUs (rayStartParams num-cpus,
else resources.cpu) over a rank's CPUs; -1 when neither says (ranks asking only custom
resources).
*/}}
{{- define "stalwart.group.ranks" -}}
{{- $g := .g }}
{{- if not (kindIs "invalid" (dig "ranksPerPod" nil $g)) }}
{{- int $g.ranksPerPod }}
{{- else }}
{{- $res := dig "resources" (dict) (default (dict) .root.Values.job) }}
{{- $rankGpu := float64 (dig "gpu" 0 $res) }}
{{- $rankCpu := float64 (dig "cpu" 1 $res) }}
{{- $params := dig "rayStartParams" (dict) $g }}
{{- $gpus := float64 (dig "num-gpus" (dig "resources" "gpu" 0 $g) $params) }}
{{- $cpus := -1.0 }}
{{- if hasKey $params "num-cpus" }}
{{- $cpus = include "stalwart.cpus" (list (get $params "num-cpus") (printf "%s.rayStartParams.num-cpus" .where)) | float64 }}
{{- else if dig "resources" "cpu" "" $g }}
{{- $cpus = include "stalwart.cpus" (list $g.resources.cpu (printf "%s.resources.cpu" .where)) | float64 }}
{{- end }}
{{- if gt $rankGpu 0.0 }}
{{- printf "%d" (int64 (floor (divf $gpus $rankGpu))) }}
{{- else if and (gt $rankCpu 0.0) (ge $cpus 0.0) }}
{{- printf "%d" (int64 (floor (divf $cpus $rankCpu))) }}
{{- else }}
{{- "-1" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
stalwart.group.shm: the sizeLimit of the group's /dev/shm, or "" for none.
- shm.sizeLimit when given;
- with job.checkpoint.state_size_per_rank (else checkpointMemory.stateSizePerRank): the
  node's own shards (state x ranks x versions, as ckpt/footprint.py counts them),
  Ray's object store (rayStartParams object-store-memory, else Ray's default of 30% of the
  memory) and 1 GiB for NCCL and Ray's own files. The copies the node keeps of its peers'
  shards (checkpoint.replicas - 1 of them) are in its agent's memory: the render fails when
  shards, copies and object store do not fit in resources.memory;
- else resources.memory (KubeRay's own default), or no limit without one.
*/}}
{{- define "stalwart.group.shm" -}}
{{- $g := .g }}
{{- $where := .where }}
{{- $memory := dig "resources" "memory" "" $g }}
{{- $memBytes := 0 }}
{{- if $memory }}
{{- $memBytes = int64 (include "stalwart.bytes" (list $memory (printf "%s.resources.memory" $where))) }}
{{- end }}
{{- $state := .root.Values.checkpointMemory.stateSizePerRank }}
{{- $stateField := "checkpointMemory.stateSizePerRank" }}
{{- with dig "checkpoint" "state_size_per_rank" nil (default (dict) .root.Values.job) }}
{{- $state = . }}
{{- $stateField = "job.checkpoint.state_size_per_rank" }}
{{- end }}
{{- if dig "shm" "sizeLimit" "" $g }}
{{- $g.shm.sizeLimit }}
{{- else if $state }}
{{- $ranks := int (include "stalwart.group.ranks" .) }}
{{- if lt $ranks 0 }}
{{- fail (printf "%s: set ranksPerPod (the job's ranks ask for no CPU or GPU, so the chart cannot tell how many a pod holds, and checkpointMemory.stateSizePerRank needs it)" $where) }}
{{- end }}
{{- $stateBytes := int64 (include "stalwart.bytes" (list $state $stateField)) }}
{{- $versions := int .root.Values.checkpointMemory.versions }}
{{- $replicas := int (dig "checkpoint" "replicas" 2 (default (dict) .root.Values.job)) }}
{{- /* job.checkpoint.memory_budget under 6 x replicas: the lean rule's 2 (ckpt/footprint.py) */}}
{{- $budget := dig "checkpoint" "memory_budget" nil (default (dict) .root.Values.job) }}
{{- if and $budget (lt (int $budget) (mul 6 $replicas)) }}
{{- $versions = 2 }}
{{- end }}
{{- $own := mul $stateBytes $ranks $versions }}
{{- $copies := mul $own (sub $replicas 1) }}
{{- $params := dig "rayStartParams" (dict) $g }}
{{- $store := 0 }}
{{- if hasKey $params "object-store-memory" }}
{{- $store = int64 (include "stalwart.bytes" (list (get $params "object-store-memory") (printf "%s.rayStartParams.object-store-memory" $where))) }}
{{- else }}
{{- $store = div (mul $memBytes 3) 10 }}
{{- end }}
{{- $need := add $own $copies $store }}
{{- if and $memBytes (gt $need $memBytes) }}
{{- $gi := 1073741824.0 }}
{{- fail (printf "%s: resources.memory %s is too small for the in-memory checkpoints: %d ranks x %s (%s) x %d versions = %.1f GiB of own shards, %.1f GiB of copies of peers' shards (checkpoint.replicas %d), %.1f GiB of Ray's object store: %.1f GiB; raise resources.memory, or lower checkpointMemory.versions or the ranks per pod" $where (include "stalwart.str" $memory) $ranks (include "stalwart.str" $state) $stateField $versions (divf $own $gi) (divf $copies $gi) $replicas (divf $store $gi) (divf $need $gi)) }}
{{- end }}
{{- $mi := 1048576 }}
{{- printf "%dMi" (div (add $own $store 1073741824 (sub $mi 1)) $mi) }}
{{- else if $memory }}
{{- $memory }}
{{- end }}
{{- end }}
