"""The engine's metrics: counters and the summary (summary.py), per-request latency
histograms (latency.py), the engine loop's step clock that times both (clock.py), and
data-parallel replicas' metrics merged (merge.py). See docs/serving.md#metrics."""
