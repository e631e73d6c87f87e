"""Speculative decoding, host half: when and how far to speculate (speculation.py,
policy.py), who proposes (proposer.py), and the drafter checked against the target
(loading.py); the drafters' runners are runner/draft.py and runner/heads.py.
docs/speculative_decoding.md."""
