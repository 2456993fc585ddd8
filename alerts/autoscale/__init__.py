"""Autoscaling: a pure policy engine, its outputs (gauges, signed webhook, Kubernetes scale) and replay.

``policy`` decides desired replicas per model from queue depth, TTFT p95 against the SLA, GPU
utilization and previous days' demand; ``inputs`` reads those from the collector and sidecars or
from Prometheus; ``hooks`` publishes decisions; ``service`` runs the loop (``infermeter autoscale
run``); ``replay`` runs the policy over a recorded or simulated day (``infermeter autoscale
replay``).
"""
