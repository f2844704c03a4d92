"""Repository-level checks: packaging, the reference docs, the dashboards and
alert rules, the Kubernetes manifests, the benchmarks and the measure tools."""
