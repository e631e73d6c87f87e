"""The batch pipeline benchmark's rows, tables and chart (benchmarks/bench_pipeline.py).

An arm's row comes from the batch runner's JSON summary (`seconds`: the requests'
run, after model load and warm-up) and the engine's metrics inside it; ratios are
against the first arm of the same run.
"""

from __future__ import annotations

import json

ENGINE_KEYS = ("steps", "mean_requests_per_step", "padding_waste", "preemptions",
               "compiles_after_warmup", "warmup_seconds", "warmup_compiled", "warmup_loaded",
               "memory_bandwidth_gb_per_s", "async_scheduling", "host_ms_per_step",
               "prefix_cache_hit_rate", "spec_verify_steps",
               "spec_tokens_per_request_step", "spec_draft_time_share", "spec_skipped_cost",
               "spec_skipped_prompt_chunks", "spec_skipped_no_match")
# Keys another part of the engine may not report yet: null until it does.
UTILISATION_KEYS = ("roofline_fraction", "mfu", "achieved_tflops", "peak_tflops")


def last_json_object(text: str) -> dict:
    """The last JSON object printed with indent in `text` (after logs and progress)."""
    start = text.rfind("\n{\n") + 1 if "\n{\n" in text else text.index("{")
    return json.JSONDecoder().raw_decode(text[start:])[0]


def arm_row(summary: dict, process_seconds: float, *, num_docs: int, price_per_hour: float,
            base: dict | None, previous: dict | None = None) -> dict:
    """One arm's figures; `base` is the first arm's row and `previous` the arm's before
    it (None for the first arm): what each arm adds shows in its factor over the one
    before."""
    engine = summary["engine"]
    seconds = summary["seconds"]
    computed = engine["prompt_tokens"]
    row = {
        "seconds": seconds,
        "process_seconds": round(process_seconds, 1),
        "startup_seconds": round(process_seconds - seconds, 1),
        "documents_done": summary["done"], "errors": summary["errors"],
        "output_tokens": summary["completion_tokens"],
        "output_tokens_per_s": round(summary["completion_tokens"] / max(seconds, 1e-9), 1),
        "prefill_tokens_computed": computed,
        "prefill_tokens_cached": engine.get("prompt_tokens_cached"),
        "prefill_tokens_computed_per_doc": round(computed / max(num_docs, 1), 1),
        "prefill_share_of_first_arm": round(computed / base["prefill_tokens_computed"], 4)
        if base else 1.0,
        "acceptance_rate": engine.get("spec_acceptance_rate"),
        "mean_acceptance_length": engine.get("spec_mean_acceptance_length"),
        **{key: engine.get(key) for key in UTILISATION_KEYS},
        "cost_per_1000_docs": round(price_per_hour * seconds / 3600 * 1000 / num_docs, 5),
        "factor_over_first_arm": round(base["seconds"] / seconds, 3) if base else 1.0,
        "factor_over_previous_arm": round(previous["seconds"] / seconds, 3)
        if previous else 1.0,
    }
    row["engine"] = {key: engine[key] for key in ENGINE_KEYS if key in engine}
    return row


def memory_wall_rows(rows: dict[str, dict], before: str, after: list[str]) -> list[dict]:
    """The before / after rows of the memory-wall write-ups, arm `before` against each of
    `after` (the arms present)."""
    after = [name for name in after if name in rows]
    measures = (
        ("device utilisation: roofline fraction (bytes a step must read / step time / "
         "probed bandwidth)", "roofline_fraction"),
        ("device utilisation: MFU (model FLOPs / step time / peak)", "mfu"),
        ("generation tokens/s", "output_tokens_per_s"),
        ("prefill compute per call (prompt tokens computed per document)",
         "prefill_tokens_computed_per_doc"),
        ("total runtime (s, without start-up)", "seconds"),
        ("inference cost per 1,000 documents (price units)", "cost_per_1000_docs"),
    )
    return [{"row": label, "before": rows[before].get(key),
             **{f"after_{name}": rows[name].get(key) for name in after}}
            for label, key in measures]


def prefill_vs_audit(rows: dict[str, dict], audit: dict, arm: str) -> dict:
    """The measured prefill share of `arm` against audit's projection (1 - saving)."""
    projected = round(1 - audit["projected_prefill_saving"], 4)
    measured = rows[arm]["prefill_share_of_first_arm"]
    gap = round(100 * (measured - projected), 2)
    missed = audit["served_tokens"] - (rows[arm]["prefill_tokens_cached"] or 0)
    out = {"arm": arm, "projected_share": projected, "measured_share": measured,
           "gap_points": gap, "within_1_point": abs(gap) <= 1.0,
           "audit_served_tokens": audit["served_tokens"],
           "engine_cached_tokens": rows[arm]["prefill_tokens_cached"],
           "cached_tokens_missed": missed}
    if missed > 0:
        out["why"] = (
            "audit replays prompts one at a time through a cache that never evicts; the "
            "engine's pool evicts cached pages (prefix_cache_evictions), so text two "
            "documents share far apart in the input is computed again: "
            "--kv_offloading_size keeps those pages in host memory "
            "(docs/kv_cache.md#the-host-tier)")
    return out


def notes(rows: dict[str, dict], quantization: str) -> list[str]:
    """Plain sentences on what each arm added and where a step gained nothing."""
    out = []
    names = list(rows)
    for name in names[1:]:
        row = rows[name]
        out.append(f"{name}: {row['factor_over_previous_arm']}x over the arm before, "
                   f"{row['factor_over_first_arm']}x over {names[0]}")
    spec = rows.get("speculative")
    if spec and spec["factor_over_previous_arm"] < 1.05:
        engine = spec["engine"]
        out.append(
            "speculative: little or no gain over the arm before; the load-adaptive policy "
            f"verified drafts in {engine.get('spec_verify_steps')} of {engine.get('steps')} "
            f"steps and skipped {engine.get('spec_skipped_cost')} request-steps for cost "
            "(a verify step of S x (k + 1) tokens measured too slow against the expected "
            "accepted tokens), "
            f"{engine.get('spec_skipped_prompt_chunks')} because the step carried a prompt "
            f"chunk and {engine.get('spec_skipped_no_match')} for no n-gram match"
            + ("; its steps ran synchronously (no asynchronous scheduling with speculation)"
               if engine.get("async_scheduling") == 0 else ""))
    quant = rows.get("quantized")
    if quant and spec and quant["seconds"] >= spec["seconds"]:
        out.append(f"quantized ({quantization}) does not pay on this device: "
                   f"{quant['seconds']} s against the speculative arm's {spec['seconds']} s")
    return out


def markdown(result: dict) -> str:
    """The arms table and the before / after table, for docs/benchmarks.md."""
    rows = result["arms"]
    lines = ["| arm | run s | start-up s | output tok/s | prefill computed (share) | "
             "acceptance (mean length) | roofline | MFU | cost / 1,000 docs | "
             "vs arm before | factor |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in rows.items():
        spec = (f"{row['acceptance_rate']} ({row['mean_acceptance_length']})"
                if row["acceptance_rate"] is not None else "")
        lines.append(
            f"| {name} | {row['seconds']} | {row['startup_seconds']} | "
            f"{row['output_tokens_per_s']} | {row['prefill_tokens_computed']:,} "
            f"({row['prefill_share_of_first_arm']:.1%}) | {spec} | "
            f"{_cell(row['roofline_fraction'])} | {_cell(row['mfu'])} | "
            f"{row['cost_per_1000_docs']:.4g} | {row['factor_over_previous_arm']}x | "
            f"**{row['factor_over_first_arm']}x** |")
    wall = result.get("memory_wall", [])
    if wall:
        heads = [k for k in wall[0] if k != "row"]
        lines += ["", "| | " + " | ".join(heads) + " |",
                  "| --- |" + " --- |" * len(heads)]
        lines += ["| " + row["row"] + " | " + " | ".join(_cell(row[h]) for h in heads) + " |"
                  for row in wall]
    return "\n".join(lines)


def _cell(value: object) -> str:
    if value is None:
        return "n/a"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def chart(result: dict, path: str) -> None:
    """A PNG: per arm, run time (start-up stacked above it) and cost per 1,000 documents."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = result["arms"]
    names = list(rows)
    seconds = [rows[n]["seconds"] for n in names]
    startup = [rows[n]["startup_seconds"] for n in names]
    cost = [rows[n]["cost_per_1000_docs"] for n in names]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.bar(names, seconds, color="tab:blue", label="run (model loaded and warm)")
    left.bar(names, startup, bottom=seconds, color="tab:gray", alpha=0.5,
             label="process start-up and warm-up")
    for i, n in enumerate(names):
        left.text(i, seconds[i], f"{rows[n]['factor_over_first_arm']}x", ha="center",
                  va="bottom")
    left.set_ylabel("seconds")
    left.set_title(f"{result['workload']['documents']} documents")
    left.legend(fontsize=8)
    right.bar(names, cost, color="tab:green")
    right.set_ylabel(f"cost per 1,000 documents (at {result['price_per_hour']} / hour)")
    right.set_title("inference cost")
    for axis in (left, right):
        axis.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
