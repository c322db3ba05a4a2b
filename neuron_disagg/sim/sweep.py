"""Runs of the model over grids: the mode x rate x input-length sweep, the published points, the
push/pull crossover, and the descriptor-count scan that shows what pull's mechanism can explain.
Kept apart from printing (``report.py``) so tests and ``--json`` get numbers, not text."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .metrics import Summary, average, summarize
from .model import Scenario, simulate
from .params import Profile, Sourced
from .steptime import descriptors

# The published table (vLLM PR 35264 author's p5en runs; shared/notes/benchmarking.md).
PUBLISHED = [
    # (label, mode, rate, input_len, metric, value_ms)
    ("8 QPS x 16k TTFT", "push", 8.0, 16384, "ttft_p50_ms", 540.0),
    ("8 QPS x 16k TTFT", "pull", 8.0, 16384, "ttft_p50_ms", 1744.0),
    ("8 QPS x 16k TPOT", "push", 8.0, 16384, "tpot_p50_ms", 7.0),
    ("8 QPS x 16k TPOT", "pull", 8.0, 16384, "tpot_p50_ms", 10.4),
    ("1 QPS x 1k TPOT", "push", 1.0, 1024, "tpot_p50_ms", 5.7),
    ("1 QPS x 1k TPOT", "pull", 1.0, 1024, "tpot_p50_ms", 5.7),
]
FITTED = {("push", 8.0, 16384, "ttft_p50_ms"), ("push", 1.0, 1024, "tpot_p50_ms")}


@dataclass(frozen=True)
class SweepOptions:
    output_len: int = 128
    requests: int = 400
    seed: int = 0
    burstiness: float = 1.0
    num_p: int = 1
    num_d: int = 1
    chunk_tokens: int | None = None


def run_point(profile: Profile, mode: str, rate: float, input_len: int, opts: SweepOptions,
              seed: int | None = None) -> Summary:
    sc = Scenario(mode, rate, input_len, opts.output_len, opts.requests, opts.seed if seed is None else seed,
                  opts.burstiness, opts.num_p, opts.num_d, opts.chunk_tokens)
    return summarize(simulate(profile, sc))


def sweep(profile: Profile, rates: list[float], input_lens: list[int], opts: SweepOptions,
          modes: tuple[str, ...] = ("push", "pull")) -> list[Summary]:
    return [run_point(profile, mode, rate, length, opts)
            for length in input_lens for rate in rates for mode in modes]


def pair(summaries: list[Summary], rate: float, input_len: int) -> tuple[Summary, Summary]:
    push = next(s for s in summaries if (s.mode, s.rate, s.input_len) == ("push", rate, input_len))
    pull = next(s for s in summaries if (s.mode, s.rate, s.input_len) == ("pull", rate, input_len))
    return push, pull


METRICS = {"TTFT": "ttft_p50_ms", "TPOT": "tpot_p50_ms"}


def within(push: Summary, pull: Summary, metric: str, tolerance: float = 0.05) -> bool:
    """Push and pull equal within ``tolerance`` on one metric (``ttft_p50_ms`` or ``tpot_p50_ms``)."""
    return abs(getattr(pull, metric) / getattr(push, metric) - 1) <= tolerance


def crossover(summaries: list[Summary], rates: list[float], input_lens: list[int],
              tolerance: float = 0.05) -> dict[str, dict[int, float | None]]:
    """Per metric and input length, the highest swept rate at and below which push and pull stay
    within ``tolerance`` (None: they differ even at the lowest rate swept)."""
    out: dict[str, dict[int, float | None]] = {}
    for name, metric in METRICS.items():
        out[name] = {}
        for length in input_lens:
            best = None
            for rate in sorted(rates):
                if not within(*pair(summaries, rate, length), metric, tolerance):
                    break
                best = rate
            out[name][length] = best
    return out


@dataclass(frozen=True)
class Reproduced:
    label: str
    mode: str
    metric: str
    published_ms: float
    simulated_ms: float
    spread_ms: float
    fitted: bool

    @property
    def error(self) -> float:
        return self.simulated_ms / self.published_ms - 1


def reproduce(profile: Profile, opts: SweepOptions, seeds: tuple[int, ...] = (0, 1, 2)) -> list[Reproduced]:
    """Each published point, simulated with several seeds: mean of the per-seed medians, and the
    spread (max - min) across seeds, because near saturation one seed is not a measurement."""
    cache: dict[tuple, list[Summary]] = {}
    rows = []
    for label, mode, rate, length, metric, value in PUBLISHED:
        key = (mode, rate, length)
        if key not in cache:
            cache[key] = [run_point(profile, mode, rate, length, opts, seed) for seed in seeds]
        values = [getattr(s, metric) for s in cache[key]]
        rows.append(Reproduced(label, mode, metric, value, float(np.mean(values)), max(values) - min(values),
                               (mode, rate, length, metric) in FITTED))
    return rows


SCAN_COUNTS = (2_048, 8_192, 12_288, 18_880, 32_768, 45_000)


def descriptor_scan(profile: Profile, opts: SweepOptions, counts: tuple[int, ...] = SCAN_COUNTS,
                    rate: float = 8.0, input_len: int = 16384, seeds: tuple[int, ...] = (0, 1, 2)
                    ) -> list[tuple[int, Summary, Summary]]:
    """Pull and push at one point as the per-request descriptor count (fragmentation) varies, each
    the mean of three seeds like ``reproduce``: the test of whether one count explains the
    published pull TTFT and TPOT together."""
    rows = []
    blocks = profile.geometry.blocks(input_len)
    regions = profile.geometry.regions_per_rank()
    for count in counts:
        run_blocks = blocks / max(1.0, count / regions)
        p = profile.replace(run_blocks=Sourced(run_blocks, "blocks", "assumed: descriptor scan"))
        rows.append((descriptors(p, input_len),
                     average([run_point(p, "push", rate, input_len, opts, seed) for seed in seeds]),
                     average([run_point(p, "pull", rate, input_len, opts, seed) for seed in seeds])))
    return rows


STAGES = (
    ("arrival -> prefill start", "spec.arrival_s", "prefill_start_s"),
    ("prefill", "prefill_start_s", "prefill_end_s"),
    ("prefill end -> transfer start", "prefill_end_s", "transfer_start_s"),
    ("transfer", "transfer_start_s", "kv_loaded_s"),
    ("KV loaded -> first token", "kv_loaded_s", "first_token_s"),
)


def _stamp(record, name: str) -> float:
    value = record
    for part in name.split("."):
        value = getattr(value, part)
    return value


@dataclass(frozen=True)
class Breakdown:
    mode: str
    stages_ms: dict[str, float]   # mean per stage; the stages add up to the mean TTFT
    ttft_mean_ms: float
    p_peak_blocks: float          # most KV blocks P held at once (mean over seeds)
    p_capacity_blocks: float


def ttft_breakdown(profile: Profile, opts: SweepOptions, rate: float = 8.0, input_len: int = 16384,
                   seeds: tuple[int, ...] = (0, 1, 2)) -> list[Breakdown]:
    """Where each mode's mean TTFT goes at one point, and how full P's KV pool gets: the test of
    which candidate mechanism has room to add a second to pull's TTFT."""
    out = []
    for mode in ("push", "pull"):
        sums = {label: [] for label, _, _ in STAGES}
        ttft, peaks = [], []
        for seed in seeds:
            sc = Scenario(mode, rate, input_len, opts.output_len, opts.requests, seed, opts.burstiness,
                          opts.num_p, opts.num_d, opts.chunk_tokens)
            run = simulate(profile, sc)
            kept = sorted(run.records, key=lambda r: r.spec.rid)[int(len(run.records) * 0.1):]
            for label, start, end in STAGES:
                sums[label] += [_stamp(r, end) - _stamp(r, start) for r in kept]
            ttft += [r.ttft_s for r in kept]
            peaks.append(run.p_peak_blocks)
        out.append(Breakdown(mode, {k: float(np.mean(v)) * 1e3 for k, v in sums.items()}, float(np.mean(ttft)) * 1e3,
                             float(np.mean(peaks)), profile.v("p_blocks")))
    return out


def md1_extra_service_s(service_s: float, rate: float, extra_wait_s: float) -> float:
    """How much longer each P service would have to be for the M/D/1 mean wait in P's queue to grow
    by ``extra_wait_s`` (closed form W = rate D^2 / (2 (1 - rate D)), solved by bisection): the size
    of a per-request P cost that queueing alone would amplify into the published pull gap."""
    def wait(d: float) -> float:
        return rate * d * d / (2 * (1 - rate * d))

    target = wait(service_s) + extra_wait_s
    lo, hi = service_s, 1 / rate
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if wait(mid) < target else (lo, mid)
    return (lo + hi) / 2 - service_s
