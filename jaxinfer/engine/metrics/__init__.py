"""The engine's metrics: counters and the summary (summary.py), per-request latency
histograms (latency.py), and data-parallel replicas' metrics merged (merge.py)."""
