"""The per-bucket table `python -m jaxinfer aot` prints, and its progress lines on stderr
as each bucket compiles (jaxinfer/aot.py builds the report; docs/aot.md reads it)."""

from __future__ import annotations

from typing import Any

from jaxinfer.sizing.accelerators import GIB


def format_table(report: dict[str, Any]) -> str:
    """The per-bucket table `python -m jaxinfer aot` prints: one block per replica
    compiled."""
    head = (f"{report['device']} ({report['topology']}, {report['layout']}: compiled for "
            f"{report['tensor_parallel_size'] * report.get('pipeline_parallel_size', 1)} chips "
            f"a replica, {report['chips_used']} of "
            f"{report['chips_in_slice']} used; figures per chip; usable HBM "
            f"{report['chip_usable_hbm_bytes'] / GIB:.2f} GiB a chip)")
    if report.get("tensor_parallel_note"):
        head += f"\n{report['tensor_parallel_note']}"
    if "plan" not in report:
        return f"{head}\ndoes not fit: {report['error']}"
    plan = report["plan"]
    rows = [r for rep in report["replicas"] for r in rep["buckets"] if r["compiled"]]
    worst = max((r["args_vs_plan"] for r in rows), default=0)
    lines = [head, f"plan per chip: weights {plan['weight_gb']} GB + KV pool "
             f"{plan['kv_cache_gb']} GB ({plan['num_pages']} pages, {plan['kv_tokens']} "
             f"tokens); compiled arguments within {100 * worst:.2f}% of it",
             "roofline = max(FLOPs / peak, bytes / HBM bandwidth): an ESTIMATE, attention "
             "counted at max_model_len, collectives not counted; AR / AG: all-reduces / "
             "all-gathers in the compiled HLO"]
    for replica in report["replicas"]:
        lines.append(f"replica {replica['replica']}: chips {replica['chips']}")
        lines += _bucket_lines(replica["buckets"])
    return "\n".join(lines)


def exit_code(report: dict[str, Any]) -> int:
    """1 when the model does not fit the slice at all, 3 when some buckets did not
    compile, else 0 (docs/cli.md#exit-codes)."""
    if "plan" not in report:
        return 1
    rows = [r for rep in report["replicas"] for r in rep["buckets"]]
    return 3 if any(not r["compiled"] for r in rows) else 0


def _bucket_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'tokens':>6} {'slots':>5} {'args GB':>8} {'temp GB':>8} {'HBM %':>6} "
             f"{'GFLOP':>9} {'GB moved':>9} {'roofline ms':>11} {'AR':>4} {'AG':>3} bound"]
    for r in rows:
        if not r["compiled"]:
            lines.append(f"{r['tokens']:>6} {r['slots']:>5} does not compile: {r['error']}")
            continue
        lines.append(f"{r['tokens']:>6} {r['slots']:>5} {r['argument_bytes'] / 1e9:8.3f} "
                     f"{r['temp_bytes'] / 1e9:8.3f} {100 * r['usable_hbm_fraction']:6.1f} "
                     f"{r['flops'] / 1e9:9.1f} {r['bytes_accessed'] / 1e9:9.2f} "
                     f"{r['roofline_estimate_ms']:11.3f} {r['collectives']['all-reduce']:>4} "
                     f"{r['collectives']['all-gather']:>3} {r['bound']}")
    return lines


def progress_line(event: dict[str, Any]) -> str:
    """One stderr line for `aot.compile_report`'s progress event: what is to be compiled,
    then each bucket as its compile ends (seconds with its lowering)."""
    if event["stage"] == "start":
        replicas = event["replicas"]
        which = (f"replicas {' and '.join(map(str, replicas))} of " if len(replicas) > 1
                 else "")
        return (f"aot: compiling {event['total']} {_plural(event['total'], 'step')} "
                f"({event['buckets']} {_plural(event['buckets'], 'bucket')}) for {which}"
                f"{event['device']} ({event['layout']}), one at a time: tens of seconds to "
                "minutes each on a CPU host")
    replica = f"replica {event['replica']}, " if len(event["replicas"]) > 1 else ""
    kind = "decode" if event["decode"] else "mixed"
    outcome = "compiled" if event["compiled"] else "does not compile (see the table)"
    return (f"aot: {replica}bucket {event['number']}/{event['total']}: {event['tokens']} "
            f"{_plural(event['tokens'], 'token')} x {event['slots']} "
            f"{_plural(event['slots'], 'seq')} ({kind}) {outcome} in {event['seconds']:.1f} s "
            f"({event['elapsed_s'] / 60:.1f} min so far)")


def _plural(count: int, word: str) -> str:
    return word if count == 1 else f"{word}s"
