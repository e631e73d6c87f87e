"""Host-side serving: requests, the scheduler and its page pool, the runner (the one
bridge to the device), loading a checkpoint into a runner, and the engine loop.
See docs/architecture.md (#one-step, #2-layout)."""
