"""Data parallelism and multi-host serving on the host: one engine per replica
(data_parallel.py), which replica a request goes to (routing.py), and process 0's
adds and aborts replayed on every process (lockstep.py). docs/parallelism.md."""
