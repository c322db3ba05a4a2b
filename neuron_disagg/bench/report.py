"""What `neuron-disagg bench` writes into its results directory — ``results.json``, ``results.md``
and PNG plots — and the ratio table it prints. Pure functions of the run results."""

from __future__ import annotations

import json
from pathlib import Path
from collections.abc import Iterable

from .. import timeline
from .load import RunResult
from .topology import REFERENCE


def ratio(value: float | None, base: float | None) -> float | None:
    return round(value / base, 2) if value and base else None


def _find(results: list[RunResult], mode: str, rate: float, input_len: int) -> RunResult | None:
    return next((r for r in results if (r.mode, r.rate, r.input_len) == (mode, rate, input_len)), None)


def rows(results: list[RunResult]) -> list[dict]:
    """One row per run with its ratios to the reference connector and to monolithic, side by side
    from the same invocation."""
    out = []
    for r in results:
        ref = _find(results, REFERENCE, r.rate, r.input_len)
        mono = _find(results, "monolithic", r.rate, r.input_len)
        out.append({
            **r.to_json(),
            "ttft_p50_vs_reference": ratio(r.ttft_p50_ms, ref.ttft_p50_ms if ref else None),
            "ttft_p99_vs_reference": ratio(r.ttft_p99_ms, ref.ttft_p99_ms if ref else None),
            "tpot_p50_vs_reference": ratio(r.tpot_p50_ms, ref.tpot_p50_ms if ref else None),
            "ttft_p50_vs_monolithic": ratio(r.ttft_p50_ms, mono.ttft_p50_ms if mono else None),
            "ttft_p50_spread": _spread(r.rounds_ttft_p50_ms),
        })
    return out


def _spread(values: list[float | None] | None) -> str | None:
    """Each round's TTFT p50 as "lowest-highest" (--rounds), else None."""
    measured = [v for v in values or () if v is not None]
    return f"{min(measured):.0f}-{max(measured):.0f}" if measured else None


def _fmt(value, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


TABLE_COLUMNS = (("mode", "mode", 0), ("rate", "req/s", 2), ("input_len", "input", 0),
                 ("ttft_p50_ms", "TTFT p50 ms", 0), ("ttft_p50_spread", "rounds' p50 ms", 0),
                 ("ttft_p99_ms", "TTFT p99 ms", 0),
                 ("tpot_p50_ms", "TPOT p50 ms", 1), ("tpot_p99_ms", "TPOT p99 ms", 1),
                 ("decode_imbalance", "D max/mean", 2), ("prediction_error", "P pred. err p50/p99 ms", 0),
                 ("stopped_d_binds", "to stopped D", 0), ("prefill_legs_imbalance", "P legs max/mean", 2),
                 ("decode_legs_imbalance", "D legs max/mean", 2), ("prefill_held_share", "P held", 2),
                 ("decode_held_share", "D held", 2), ("kv_bytes_per_request", "KV bytes/req", 0),
                 ("affinity_p99_ms", "match p99 ms", 2), ("ttft_p50_vs_reference", f"TTFT/{REFERENCE}", 2),
                 ("tpot_p50_vs_reference", f"TPOT/{REFERENCE}", 2), ("ttft_p50_vs_monolithic", "TTFT/mono", 2),
                 ("prefill_step", "P step p50/p99 us", 0), ("prefill_step_cpu", "P CPU p50/p99 us", 0),
                 ("decode_step", "D step p50/p99 us", 0), ("decode_step_cpu", "D CPU p50/p99 us", 0),
                 ("descriptors_per_transfer", "desc/transfer", 0), ("p_busy", "P busy", 2),
                 ("completed", "ok", 0), ("failed", "failed", 0))
#: Columns shown only where some result has a value: the rounds' spread (--rounds), descriptors
#: (our connector's modes) and P's share busy (--p-busy).
OPTIONAL_COLUMNS = ("ttft_p50_spread", "descriptors_per_transfer", "p_busy", "tpot_p99_ms", "decode_imbalance",
                    "prediction_error", "stopped_d_binds", "prefill_legs_imbalance", "decode_legs_imbalance",
                    "prefill_held_share", "decode_held_share", "kv_bytes_per_request", "affinity_p99_ms")


def _cell(row: dict, key: str, digits: int) -> str:
    if key in row:
        return _fmt(row[key], digits)
    low, high = _pair(row, key)  # a p50/p99 pair
    return "-" if low is None and high is None else f"{_fmt(low, digits)}/{_fmt(high, digits)}"


def _pair(row: dict, key: str) -> tuple:
    unit = "ms" if key == "prediction_error" else "us"
    return row[f"{key}_p50_{unit}"], row[f"{key}_p99_{unit}"]


def _shown(row: dict, key: str) -> bool:
    return row[key] is not None if key in row else any(v is not None for v in _pair(row, key))


def table(results: list[RunResult]) -> list[list[str]]:
    """Header and rows of the comparison table (strings), in the run's order. Connector step times
    are p50/p99 pairs, wall clock ("step") and the engine thread's CPU time ("CPU")."""
    table_rows = rows(results)
    columns = [c for c in TABLE_COLUMNS
               if c[0] not in OPTIONAL_COLUMNS or any(_shown(row, c[0]) for row in table_rows)]
    header = [title for _, title, _ in columns]
    body = [[_cell(row, key, digits) for key, _, digits in columns] for row in table_rows]
    return [header, *body]


def goals_lines(goals: list[dict]) -> list[str]:
    """``meta["goals"]`` (``preset.evaluate``) as Markdown table lines."""
    lines = ["| goal | req/s | input | measured | bound | met |", "|---|---|---|---|---|---|"]
    for g in goals:
        met = "not measured" if g["met"] is None else ("yes" if g["met"] else "**no**")
        lines.append(f"| {g['goal']} | {g['rate']} | {g['input_len']} | {_fmt(g['measured'], 2)} | "
                     f"{_fmt(g['bound'], 2)} | {met} |")
    return lines


def goals_text(goals: list[dict], preset: str | None) -> str:
    met = sum(1 for g in goals if g["met"])
    return (f"Goals of --preset {preset}: {met} of {len(goals)} met\n"
            + "\n".join(f"  {'met    ' if g['met'] else 'NOT MET' if g['met'] is False else 'no data'}  {g['goal']} "
                         f"at {g['rate']} req/s, input {g['input_len']}: {_fmt(g['measured'], 2)} (bound {_fmt(g['bound'], 2)})"
                         for g in goals))


def drift(first: list[RunResult], again: list[RunResult]) -> list[dict]:
    """Monolithic at the run's start and again at its end, point by point: how far this machine's
    speed moved while the topologies ran one after another (``meta["drift"]``)."""
    out = []
    for r in again:
        before = _find(first, "monolithic", r.rate, r.input_len)
        if before is not None:
            out.append({"rate": r.rate, "input_len": r.input_len, "error": r.error,
                        "ttft_p50_ms": [before.ttft_p50_ms, r.ttft_p50_ms],
                        "tpot_p50_ms": [before.tpot_p50_ms, r.tpot_p50_ms],
                        "ttft_p50_ratio": ratio(r.ttft_p50_ms, before.ttft_p50_ms),
                        "tpot_p50_ratio": ratio(r.tpot_p50_ms, before.tpot_p50_ms)})
    return out


def drift_line(points: list[dict]) -> str:
    """``meta["drift"]`` in words: ratios between modes closer than this are within the run's noise."""
    parts = []
    for d in points:
        where = f"{d['rate']} req/s in {d['input_len']}"
        if d["error"]:
            parts.append(f"{where}: not measured again ({d['error'].splitlines()[0]})")
            continue
        (t0, t1), (p0, p1) = d["ttft_p50_ms"], d["tpot_p50_ms"]
        parts.append(f"{where}: TTFT p50 {_fmt(t0)} -> {_fmt(t1)} ms ({_fmt(d['ttft_p50_ratio'], 2)}x), "
                     f"TPOT p50 {_fmt(p0, 1)} -> {_fmt(p1, 1)} ms ({_fmt(d['tpot_p50_ratio'], 2)}x)")
    return ("Drift (monolithic measured first and again last; modes whose ratios differ by less than "
            "this are within the run's drift): " + "; ".join(parts))


def idle_line(idle: dict[str, dict[str, float]], window_s: float | None) -> str:
    """Idle CPU per instance, from ``meta["idle_cpu_percent"]`` (topology -> instance -> %)."""
    parts = [f"{topology}: " + ", ".join(f"{name} {pct:.1f}%" for name, pct in instances.items())
             for topology, instances in idle.items() if instances]
    window = f" over {window_s:g} s" if window_s else ""
    return f"Idle CPU (% of one core{window}, before any load): " + "; ".join(parts)


def thread_line(r: RunResult) -> str:
    """Our transfer threads' CPU over one run, from ``RunResult.thread_cpu_percent``."""
    return (f"{r.mode} {r.rate} req/s in {r.input_len}: transfer threads' CPU (% of one core over the run) "
            + ", ".join(f"{name} {pct:.2f}" for name, pct in (r.thread_cpu_percent or {}).items()))


def markdown(results: list[RunResult], meta: dict) -> str:
    header, *body = table(results)
    lines = [f"# neuron-disagg bench — {meta.get('started', '')}", "",
             f"Model `{meta.get('model')}`; {meta.get('prompts')} requests per point, output "
             f"{meta.get('output_len')} tokens, burstiness {meta.get('burstiness')} (1 = Poisson). "
             f"Ratios are to `{REFERENCE}` (vLLM's NixlConnector) and to monolithic vLLM at the same "
             "rate and input length, measured in this one run."
             + (f" The modes ran in {meta['rounds']} interleaved rounds, the idle topologies paused: each "
                "figure is the median over the rounds; `rounds' p50 ms` gives the lowest and highest "
                "round's TTFT p50." if meta.get("rounds", 1) > 1 else ""), "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    if meta.get("p_prefill_ms"):
        lines += ["", "P's prefill time alone (one request at a time, before any load): " + ", ".join(
            f"{ms:.0f} ms at {n} tokens" for n, ms in meta["p_prefill_ms"].items())
            + f"; the rates keep P {', '.join(f'{b:.0%}' for b in meta.get('p_busy') or [])} busy (`P busy`)."]
    if meta.get("churn"):
        lines += ["", "Each topology's block pools were churned first (requests of spread lengths ending out of "
                  "order), so transfers' blocks are not contiguous; `desc/transfer` is the NIXL descriptors our "
                  "connector posted per transfer, after merging contiguous ones."]
    if meta.get("goals"):
        lines += ["", f"## Goals of `--preset {meta.get('preset')}`", "", *goals_lines(meta["goals"])]
    split = [r for r in results if r.p_and_after_ms]
    if split:
        lines += ["", "## Each mode's TTFT split at P's answer (median ms, the router's marks)", "",
                  "Until P answered: the router, P's queue and its prefill, alike in every mode. After: what "
                  "getting the KV to D and D's first step add; in push modes D may hold the KV before the "
                  "router has P's answer.", "",
                  "| mode | req/s | input | until P answered | after P answered | TTFT p50 |", "|---|---|---|---|---|---|"]
        lines += [f"| {r.mode} | {r.rate} | {r.input_len} | {_fmt(r.p_and_after_ms.get('until_p_answered'), 1)} | "
                  f"{_fmt(r.p_and_after_ms.get('after_p_answered'), 1)} | {_fmt(r.ttft_p50_ms)} |" for r in split]
    broken = [r for r in results if r.breakdown_ms]
    if broken:
        segments = [s for s in (*timeline.PUSH_SEGMENTS, *timeline.PULL_SEGMENTS) if any(
            s in r.breakdown_ms for r in broken)]
        segments = list(dict.fromkeys(segments)) + ["ttft"]
        lines += ["", "## TTFT breakdown (median ms per segment, our connector)", "",
                  "| mode | req/s | input | " + " | ".join(segments) + " |", "|" + "---|" * (len(segments) + 3)]
        for r in broken:
            lines.append(f"| {r.mode} | {r.rate} | {r.input_len} | "
                         + " | ".join(_fmt(r.breakdown_ms.get(s), 1) for s in segments) + " |")
    threads = [r for r in results if r.thread_cpu_percent]
    if threads:
        lines += ["", "## Our transfer threads' CPU while loaded", ""] + [f"- {thread_line(r)}" for r in threads]
    if meta.get("idle_cpu_percent"):
        lines += ["", idle_line(meta["idle_cpu_percent"], meta.get("idle_seconds"))]
    if meta.get("drift"):
        lines += ["", drift_line(meta["drift"])]
    errors = [r for r in results if r.error]
    if errors:
        lines += ["", "## Errors", ""] + [f"- {r.mode} at {r.rate} req/s, input {r.input_len}: {r.error}"
                                          for r in errors]
    return "\n".join(lines) + "\n"


def plots(results: list[RunResult], out_dir: Path) -> list[Path]:
    """TTFT p50/p99 and TPOT p50 against rate (one line per mode) per input length, and the
    TTFT breakdown as stacked bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for input_len in sorted({r.input_len for r in results}):
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
        for key, title, ax in (("ttft_p50_ms", "TTFT p50 (ms)", axes[0]), ("ttft_p99_ms", "TTFT p99 (ms)", axes[1]),
                               ("tpot_p50_ms", "TPOT p50 (ms)", axes[2])):
            for mode in _modes(results):
                points = sorted((r.rate, getattr(r, key)) for r in results
                                if r.mode == mode and r.input_len == input_len and getattr(r, key) is not None)
                if points:
                    ax.plot(*zip(*points, strict=True), marker="o", label=mode)
            ax.set(title=title, xlabel="request rate (req/s)")
            ax.grid(alpha=0.3)
        axes[0].legend()
        fig.suptitle(f"input {input_len} tokens")
        fig.tight_layout()
        path = out_dir / f"latency-in{input_len}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    broken = [r for r in results if r.breakdown_ms]
    if broken:
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(broken)), 4.5))
        segments = list(dict.fromkeys(s for r in broken for s in r.breakdown_ms if s != "ttft"))
        labels = [f"{r.mode}\n{r.rate}/s\nin {r.input_len}" for r in broken]
        bottom = [0.0] * len(broken)
        for segment in segments:
            values = [max(0.0, r.breakdown_ms.get(segment, 0.0)) for r in broken]
            ax.bar(labels, values, bottom=bottom, label=segment.replace("_", " "))
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set(title="TTFT breakdown, median per segment (ms)", ylabel="ms")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / "ttft-breakdown.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _modes(results: Iterable[RunResult]) -> list[str]:
    """The modes measured, in the run's order (labels such as ``push-bind-0 +stop`` included)."""
    return list(dict.fromkeys(r.mode for r in results))


def write(results: list[RunResult], meta: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, "runs": rows(results)}, indent=2))
    (out_dir / "results.md").write_text(markdown(results, meta))
    return [out_dir / "results.json", out_dir / "results.md", *plots(results, out_dir)]
