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
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
{{- end -}}
