"""Sizing: the accelerators jaxinfer knows (memory, bandwidth, chips per host) and the
memory planner that fits weights and KV pages into them, with or without the device."""
