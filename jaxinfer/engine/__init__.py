"""Host-side serving: requests, the runner bridge, and (later) the scheduler."""
