{{- define "chariot.fullname" -}}
{{- printf "%s-chariot" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "chariot.operatorName" -}}
{{- printf "%s-operator" (include "chariot.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "chariot.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "chariot.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "chariot.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "chariot.labels" -}}
app.kubernetes.io/name: chariot
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: chariot
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "chariot.selectorLabels" -}}
app.kubernetes.io/name: chariot
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* What the operator does to the objects it owns, in the watched namespaces (least privilege). */}}
{{- define "chariot.workloadRules" -}}
- apiGroups: [chariot.dev]
  resources: [modeldeployments]
  verbs: [get, list, watch, patch]
- apiGroups: [chariot.dev]
  resources: [modeldeployments/status]
  verbs: [get, patch]
- apiGroups: [chariot.dev]
  resources: [modeldeployments/finalizers]  # ownerReferences with blockOwnerDeletion
  verbs: [update]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, delete]
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [get, create, patch, delete]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]  # each group's stage pods: ingress from the group and its routers only
  verbs: [get, list, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]  # one per group (all its stages stay) and one for 2+ routers
  verbs: [get, list, create, patch, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]  # spec.autoscaling: an HPA on the same ModelDeployment is reported
  verbs: [list]
{{- end -}}

{{- define "chariot.uninstallName" -}}
{{- printf "%s-uninstall" (include "chariot.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The pre-delete hook's identity: its own, created with it, unless rbac.create is false. */}}
{{- define "chariot.uninstallServiceAccountName" -}}
{{- if .Values.rbac.create -}}
{{- include "chariot.uninstallName" . -}}
{{- else -}}
{{- include "chariot.serviceAccountName" . -}}
{{- end -}}
{{- end -}}

{{/* Annotations of every pre-delete hook object; the argument is the hook weight. Helm creates
lower weights first (the identity before the Job) and deletes them all once every hook succeeded;
a failed Job stays for `kubectl logs` until the next `helm uninstall` replaces it. */}}
{{- define "chariot.uninstallHookAnnotations" -}}
helm.sh/hook: pre-delete
helm.sh/hook-weight: {{ . | quote }}
helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded
{{- end -}}

{{/* What the pre-delete hook does: find, delete and watch ModelDeployments (nothing else). */}}
{{- define "chariot.uninstallRules" -}}
- apiGroups: [chariot.dev]
  resources: [modeldeployments]
  verbs: [get, list, delete]
{{- end -}}
