"""Text for a terminal: the sweep table, the published-vs-simulated table, the crossover, the
descriptor scan and the parameter sources. Plain fixed-width text so it pastes into an issue."""

from __future__ import annotations

from .metrics import Summary
from .params import Profile
from .sweep import Breakdown, Reproduced, md1_extra_service_s, pair


def sweep_table(summaries: list[Summary], rates: list[float], input_lens: list[int]) -> str:
    head = (f"{'input':>6} {'QPS':>5} | {'push TTFT p50':>13} {'p99':>7} | {'pull TTFT p50':>13} {'p99':>7} | "
            f"{'TPOT push':>9} {'pull':>6} | {'push/pull TTFT':>14} {'TPOT':>6}")
    lines = [head, "-" * len(head)]
    for length in input_lens:
        for rate in rates:
            push, pull = pair(summaries, rate, length)
            lines.append(
                f"{length:>6} {rate:>5g} | {push.ttft_p50_ms:>13.1f} {push.ttft_p99_ms:>7.0f} | "
                f"{pull.ttft_p50_ms:>13.1f} {pull.ttft_p99_ms:>7.0f} | "
                f"{push.tpot_p50_ms:>9.2f} {pull.tpot_p50_ms:>6.2f} | "
                f"{push.ttft_p50_ms / pull.ttft_p50_ms:>14.2f} {push.tpot_p50_ms / pull.tpot_p50_ms:>6.2f}")
    return "\n".join(lines)


def reproduction_table(rows: list[Reproduced], tolerance: float = 0.15) -> str:
    head = (f"{'published point':<18} {'mode':<5} {'published':>10} {'simulated':>10} {'seed spread':>11} "
            f"{'error':>8}  verdict")
    lines = [head, "-" * len(head)]
    for r in rows:
        verdict = "fitted here" if r.fitted else ("within ±15%" if abs(r.error) <= tolerance else "OUTSIDE ±15%")
        lines.append(f"{r.label:<18} {r.mode:<5} {r.published_ms:>8.1f}ms {r.simulated_ms:>8.1f}ms "
                     f"{r.spread_ms:>9.1f}ms {r.error * 100:>+7.1f}%  {verdict}")
    by = {(r.label, r.mode): r for r in rows}
    ttft = (by[("8 QPS x 16k TTFT", "push")], by[("8 QPS x 16k TTFT", "pull")])
    tpot = (by[("8 QPS x 16k TPOT", "push")], by[("8 QPS x 16k TPOT", "pull")])
    def ratio(pair: tuple[Reproduced, Reproduced], field: str) -> float:
        return getattr(pair[0], field) / getattr(pair[1], field)

    lines.append(f"push/pull at 8 QPS x 16k: TTFT published {ratio(ttft, 'published_ms'):.2f}, "
                 f"simulated {ratio(ttft, 'simulated_ms'):.2f}; TPOT published {ratio(tpot, 'published_ms'):.2f}, "
                 f"simulated {ratio(tpot, 'simulated_ms'):.2f}")
    return "\n".join(lines)


def crossover_text(cross: dict[str, dict[int, float | None]], rates: list[float]) -> str:
    lines = []
    for metric, per_len in cross.items():
        parts = []
        for length, rate in per_len.items():
            if rate is None:
                parts.append(f"{length}: differ already at {min(rates):g} QPS")
            elif rate == max(rates):
                parts.append(f"{length}: equal up to {rate:g} QPS (the whole sweep)")
            else:
                parts.append(f"{length}: equal up to {rate:g} QPS")
        lines.append(f"{metric} within 5% — " + "; ".join(parts))
    return "\n".join(lines)


def scan_table(rows: list[tuple[int, Summary, Summary]]) -> str:
    head = (f"{'descriptors/request':>19} | {'push TTFT':>9} {'pull TTFT':>9} | {'push TPOT':>9} {'pull TPOT':>9} | "
            f"{'D loop busy':>11}")
    lines = [head, "-" * len(head)]
    for count, push, pull in rows:
        lines.append(f"{count:>19,} | {push.ttft_p50_ms:>9.0f} {pull.ttft_p50_ms:>9.0f} | {push.tpot_p50_ms:>9.2f} "
                     f"{pull.tpot_p50_ms:>9.2f} | {pull.d_loop_busy_fraction:>10.0%}")
    return "\n".join(lines)


def scan_verdict(rows: list[tuple[int, Summary, Summary]], ttft_ms: float = 1744.0, tpot_ms: float = 10.4,
                 tolerance: float = 0.15) -> str:
    """Whether any single descriptor count reproduces the published pull TTFT and TPOT together."""
    def near(value: float, target: float) -> bool:
        return abs(value / target - 1) <= tolerance

    both = [n for n, _, pull in rows if near(pull.ttft_p50_ms, ttft_ms) and near(pull.tpot_p50_ms, tpot_ms)]
    tpot_ok = [n for n, _, pull in rows if near(pull.tpot_p50_ms, tpot_ms)]
    if both:
        return f"descriptor counts matching both published pull figures (±15%): {', '.join(f'{n:,}' for n in both)}"
    best = (f"counts that match pull TPOT {tpot_ms} ms: {', '.join(f'{n:,}' for n in tpot_ok)}" if tpot_ok
            else f"no count in the scan matches pull TPOT {tpot_ms} ms within ±15% either")
    return (f"no descriptor count reproduces pull TTFT {ttft_ms:,.0f} ms and TPOT {tpot_ms} ms together: "
            f"posting on D's loop raises TPOT long before it can add a second to TTFT ({best}).")


def sources_table(profile: Profile) -> str:
    lines = [f"{profile.name}: {profile.description}"]
    for name, p in profile.sources():
        lines.append(f"  {name:<22} {p.value:>12.4g} {p.unit:<9} {p.source}")
    return "\n".join(lines)


def breakdown_text(rows: list[Breakdown], published: list[Reproduced], prefill_s: float, rate: float = 8.0) -> str:
    """Where push's and pull's mean TTFT go, and what each candidate mechanism for pull's published
    gap can add, with the verdict stated in numbers."""
    push, pull = rows
    head = f"{'stage (mean ms)':<30} {'push':>8} {'pull':>8}"
    lines = [head, "-" * len(head)]
    for label in push.stages_ms:
        lines.append(f"{label:<30} {push.stages_ms[label]:>8.1f} {pull.stages_ms[label]:>8.1f}")
    lines.append(f"{'TTFT (mean)':<30} {push.ttft_mean_ms:>8.1f} {pull.ttft_mean_ms:>8.1f}")
    by = {(r.label, r.mode): r for r in published}
    pub_push, pub_pull = by[("8 QPS x 16k TTFT", "push")], by[("8 QPS x 16k TTFT", "pull")]
    gap_pub = pub_pull.published_ms - pub_push.published_ms
    gap_sim = pub_pull.simulated_ms - pub_push.simulated_ms
    after = [k for k in push.stages_ms if k not in ("arrival -> prefill start", "prefill")]
    handoff = sum(pull.stages_ms[k] - push.stages_ms[k] for k in after)
    extra = md1_extra_service_s(prefill_s, rate, (gap_pub - gap_sim) / 1e3)
    cap = pull.p_capacity_blocks
    lines += [
        f"pull - push TTFT (p50): published {gap_pub:,.0f} ms, simulated {gap_sim:,.0f} ms. Candidates, each "
        f"checked against vLLM 0.32's pull path:",
        f"  (a) P holds KV until D's read-done notice, freed from P's own loop (pull_worker._get_new_notifs, "
        f"Scheduler._update_from_kv_xfer_finished): peak {pull.p_peak_blocks:,.0f} of {cap:,.0f} blocks held "
        f"({pull.p_peak_blocks / cap:.1%}) — P's pool never throttles its prefills at this capacity",
        f"  (b)+(c) serial handoff (toy proxy sends D its request after P answers; D re-tokenizes) and D's step "
        f"boundaries with the async-scheduling lag: the stages after prefill cost pull {handoff:+.0f} ms vs push",
        f"  (d) a per-request cost on P's loop would need +{extra * 1e3:.1f} ms per prompt (M/D/1 at P utilisation "
        f"{rate * prefill_s:.2f}: {prefill_s * 1e3:.0f} -> {(prefill_s + extra) * 1e3:.0f} ms) to add the missing "
        f"{gap_pub - gap_sim:,.0f} ms; vLLM's pull path puts only notification polling and lease reaping on P's "
        f"loop, so nothing sources such a cost and none is modelled",
    ]
    if abs(pub_pull.error) <= 0.15:
        lines.append(f"verdict: reproduced — pull TTFT {pub_pull.simulated_ms:,.0f} ms vs "
                     f"{pub_pull.published_ms:,.0f} ms published ({pub_pull.error * 100:+.0f}%), within ±15%.")
    else:
        lines.append(f"verdict: NOT reproduced — with every mechanism grounded in vLLM's source, pull TTFT is "
                     f"{pub_pull.simulated_ms:,.0f} ms vs {pub_pull.published_ms:,.0f} ms published "
                     f"({pub_pull.error * 100:+.0f}%), outside ±15%; no fudge factor is added to close it.")
    return "\n".join(lines)
