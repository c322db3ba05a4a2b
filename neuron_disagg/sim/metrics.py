"""Summaries of a run, in the units `vllm bench serve` reports (milliseconds; TTFT and TPOT
percentiles), over the requests after a warm-up share, so a sweep reads steady state rather than
the empty system the first arrivals find."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

import numpy as np

from .model import RunResult


@dataclass(frozen=True)
class Summary:
    mode: str
    rate: float
    input_len: int
    output_len: int
    requests: int
    measured: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_mean_ms: float
    tpot_p50_ms: float
    tpot_mean_ms: float
    descriptors_per_request: float
    d_loop_busy_fraction: float

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(result: RunResult, warmup_fraction: float = 0.1) -> Summary:
    records = sorted(result.records, key=lambda r: r.spec.rid)
    skip = int(len(records) * warmup_fraction)
    kept = records[skip:] or records
    ttft = np.array([r.ttft_s for r in kept]) * 1e3
    tpot = np.array([r.tpot_s for r in kept]) * 1e3
    sc = result.scenario
    return Summary(
        mode=sc.mode, rate=sc.rate, input_len=sc.input_len, output_len=sc.output_len, requests=len(records),
        measured=len(kept), ttft_p50_ms=float(np.percentile(ttft, 50)), ttft_p99_ms=float(np.percentile(ttft, 99)),
        ttft_mean_ms=float(ttft.mean()), tpot_p50_ms=float(np.percentile(tpot, 50)), tpot_mean_ms=float(tpot.mean()),
        descriptors_per_request=float(np.mean([r.descriptors for r in kept])),
        d_loop_busy_fraction=result.d_loop_busy_s / result.end_s if result.end_s else 0.0,
    )


def average(summaries: list[Summary]) -> Summary:
    """Field-wise mean of runs of one point under different seeds (percentiles averaged per seed:
    near saturation a single seed's median is not a measurement)."""
    first = summaries[0]
    numbers = {f.name: float(np.mean([getattr(s, f.name) for s in summaries]))
               for f in fields(Summary) if f.name.endswith(("_ms", "_request", "_fraction"))}
    return replace(first, **numbers)
