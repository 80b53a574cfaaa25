"""Chariot's Kubernetes operator: the `ModelDeployment` CRD and its reconciliation (docs/architecture.md §6).

Layers, each testable on its own:
- `crd`        — the CRD (schema, printer columns, subresources): the single source of the chart's YAML;
- `spec`       — the spec as typed values; applies the schema's defaults and rejects bad fields by name;
- `render`     — pure manifest rendering (pods per group and stage, Services, router, ConfigMap);
- `reconcile`  — pure planning (gang restarts with backoff, scaling, one-group-at-a-time rollouts, status);
- `controller` — one pass against the API (`kube`), serialised per deployment;
- `handlers`   — thin kopf handlers; `cli` — `chariot operator`: `add_operator_parser`, `run_operator`.

Nothing is imported here, so `python -m chariot.operator.crd` and the pure modules stay light.
"""
