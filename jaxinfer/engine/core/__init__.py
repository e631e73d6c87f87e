"""The scheduler and what it schedules over: the page pool with its prefix cache
(page_pool.py), a request's pages per page group (kv_groups.py), the padding buckets
(buckets.py). docs/architecture.md, "The scheduling rule"."""
