"""One measured run: `vllm bench serve` against a URL at one rate and input length (open-loop
Poisson arrivals, random prompts, fixed output length, greedy), and what we read around it — the
TTFT breakdown from the timeline and the connector's time per engine step from /metrics."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Callable

import httpx

from .. import timeline
from .conversations import Conversations, converse
from ..protocol.geometry import kv_bytes_per_token


@dataclass(frozen=True)
class Load:
    rate: float
    input_len: int
    output_len: int
    prompts: int
    burstiness: float = 1.0  # 1: Poisson; < 1 burstier (gamma arrivals)
    seed: int = 0
    max_concurrency: int | None = None  # at most this many requests in flight (None: no limit)
    range_ratio: float = 0.0  # > 0: input and output lengths vary by this fraction either side
    dataset: str | None = None  # a JSONL of prompts and output lengths (``heavy_tailed_dataset``) instead of random
    workload: Conversations | None = None  # conversations played turn by turn (``conversations.py``) instead


@dataclass
class RunResult:
    mode: str
    rate: float
    input_len: int
    output_len: int
    prompts: int
    completed: int = 0
    failed: int = 0
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    e2el_p50_ms: float | None = None
    breakdown_ms: dict[str, float] | None = None  # median of each TTFT segment (our modes)
    p_and_after_ms: dict[str, float] | None = None  # median of the router's split at P's answer (every routed mode)
    prefill_step_us: float | None = None  # our connector's mean time per engine step (our modes)
    decode_step_us: float | None = None
    prefill_step_p50_us: float | None = None  # ... its p50 and p99, as histogram bucket bounds
    prefill_step_p99_us: float | None = None
    decode_step_p50_us: float | None = None
    decode_step_p99_us: float | None = None
    prefill_step_cpu_p50_us: float | None = None  # the same steps' CPU time on the engine thread
    prefill_step_cpu_p99_us: float | None = None
    decode_step_cpu_p50_us: float | None = None
    decode_step_cpu_p99_us: float | None = None
    thread_cpu_percent: dict[str, float] | None = None  # "P writer", "D receiver"...: % of a core over the run
    rounds_ttft_p50_ms: list[float | None] | None = None  # --rounds: each round's TTFT p50 (the rest: medians)
    descriptors_per_transfer: float | None = None  # our connector: NIXL descriptors posted per KV transfer
    p_busy: float | None = None  # the share of P's time the offered load asks: rate x P's measured prefill time
    decode_imbalance: float | None = None  # the router's mean of max/mean running sequences on the D's as D legs went out
    prediction_error_p50_ms: float | None = None  # P's predicted answer minus its real one (binding horizon)
    prediction_error_p99_ms: float | None = None
    stopped_d_binds: int | None = None  # D legs the router sent to a D while it was stopped (SIGSTOP)
    kv_bytes_per_request: float | None = None  # KV bytes P's and D's posted, per completed request (our modes)
    prefill_legs_imbalance: float | None = None  # the most P legs sent to one P over the mean (several P's)
    decode_legs_imbalance: float | None = None  # the same over the D's (or the monolithic instances)
    prefill_held_share: float | None = None  # of the prompt tokens the router matched, what the chosen P held
    decode_held_share: float | None = None  # ... and the chosen D
    affinity_p99_ms: float | None = None  # the router's time per request tokenizing and matching, p99 (a bucket bound)
    error: str | None = None

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class StepTime:
    """The connector's cumulative time on the engine loop, read from an instance's /metrics:
    its sum, its count, and its histogram's cumulative count per bucket bound (seconds)."""

    seconds: float = 0.0
    steps: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)


def bench_serve_command(url: str, tokenizer: str, load: Load, out_dir: Path, name: str) -> list[str]:
    """`vllm bench serve` for ``load``, saving its JSON (with per-request details) as ``name``.json."""
    command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm",
               "--base-url", url, "--model", "tiny", "--tokenizer", tokenizer,
               *(["--dataset-name", "custom", "--dataset-path", load.dataset, "--custom-output-len", "-1",
                  "--skip-chat-template", "--disable-shuffle"] if load.dataset else
                 ["--dataset-name", "random", "--random-input-len", str(load.input_len),
                  "--random-output-len", str(load.output_len)]),
               "--request-rate", str(load.rate), "--burstiness", str(load.burstiness),
               "--num-prompts", str(load.prompts), "--temperature", "0", "--ignore-eos",
               "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99",
               "--seed", str(load.seed), "--save-result", "--save-detailed", "--result-dir", str(out_dir),
               "--result-filename", f"{name}.json"]
    if load.max_concurrency:
        command += ["--max-concurrency", str(load.max_concurrency)]
    if load.range_ratio:
        command += ["--random-range-ratio", str(load.range_ratio)]
    return command


def bench_serve(url: str, tokenizer: str, load: Load, out_dir: Path, name: str,
                timeout_s: float = 3600) -> dict:
    """Runs `vllm bench serve` and returns its saved JSON."""
    out = subprocess.run(bench_serve_command(url, tokenizer, load, out_dir, name), capture_output=True, text=True,
                         timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"vllm bench serve exited with {out.returncode}: {out.stderr.strip()[-800:]}")
    return json.loads((out_dir / f"{name}.json").read_text())


def run(mode: str, url: str, tokenizer: str, load: Load, out_dir: Path,
        timeline_dir: str | None = None) -> RunResult:
    result = RunResult(mode, load.rate, load.input_len, load.output_len, load.prompts)
    started = time.time()
    name = f"{mode}-rate{load.rate}-in{load.input_len}"
    try:
        if load.workload is not None:
            raw = converse(url, tokenizer, load.workload, load.rate, load.seed)
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / f"{name}.json").write_text(json.dumps(raw))
        else:
            raw = bench_serve(url, tokenizer, load, out_dir, name)
    except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError, httpx.HTTPError) as exc:
        result.error = str(exc)
        return result
    result.completed, result.failed = int(raw.get("completed", 0)), int(raw.get("failed", 0))
    result.ttft_p50_ms, result.ttft_p99_ms = raw.get("median_ttft_ms"), raw.get("p99_ttft_ms")
    result.tpot_p50_ms, result.e2el_p50_ms = raw.get("median_tpot_ms"), raw.get("median_e2el_ms")
    result.tpot_p99_ms = raw.get("p99_tpot_ms")
    if timeline_dir:
        ended = time.time()
        result.breakdown_ms = breakdown_between(timeline_dir, started, ended)
        result.p_and_after_ms = breakdown_between(timeline_dir, started, ended, timeline.p_and_after)
        errors = sorted(e for events in timeline.load(timeline_dir).values()
                        if started <= events.get("router_arrived", -1) <= ended
                        and (e := timeline.prediction_error(events)) is not None)
        if errors:
            result.prediction_error_p50_ms = round(_quantile(errors, 0.5) * 1e3, 1)
            result.prediction_error_p99_ms = round(_quantile(errors, 0.99) * 1e3, 1)
    return result


def _quantile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``ordered``, the nearest rank."""
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def heavy_tailed_dataset(tokenizer_dir: str, input_len: int, max_output: int, prompts: int, path: Path,
                         seed: int = 0, alpha: float = 1.2, least: int = 8) -> str:
    """A JSONL for ``vllm bench serve --dataset-name custom``: ``prompts`` random prompts of about
    ``input_len`` tokens, each with an output length from a Pareto distribution (shape ``alpha``,
    at least ``least``, at most ``max_output``): most answers short, a few long, so the D's that
    happen to hold the long ones fill up while the others empty. Returns the path."""
    import random

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    lines = []
    for _ in range(prompts):
        vocab = tokenizer.vocab_size
        ids = [t for t in (rng.randrange(vocab // 20, min(vocab, 30000)) for _ in range(input_len)) if t not in special]
        prompt = tokenizer.decode(tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)[:input_len])
        output = min(max_output, int(least * (1.0 - rng.random()) ** (-1.0 / alpha)))
        lines.append(json.dumps({"prompt": prompt, "output_tokens": output}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@dataclass
class RouterReading:
    """What the bench reads from a router's /metrics around a run: the decode balance histogram's
    sum and count (``mode``'s), the legs sent to each D and each P, its time matching prompts
    against what instances hold, and the prompt tokens it routed knowing the prompt, and of those
    the ones the chosen instance held (by role)."""

    imbalance_sum: float
    imbalance_count: float
    decode_legs: dict[str, float]
    prefill_legs: dict[str, float] = field(default_factory=dict)
    affinity: StepTime = field(default_factory=StepTime)
    prefix_tokens: dict[str, float] = field(default_factory=dict)
    held_tokens: dict[str, float] = field(default_factory=dict)


def read_router(url: str, mode: str) -> RouterReading:
    """``parse_router`` of the router's /metrics at ``url`` (zeros where it cannot be read)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        text = ""
    return parse_router(text, mode)


def parse_router(text: str, mode: str) -> RouterReading:
    """A router's readings from its Prometheus text, the decode balance of its ``mode`` requests."""
    prefix = "neuron_disagg_router_"
    legs: dict[str, dict[str, float]] = {"decode": {}, "prefill": {}}
    for line in text.splitlines():
        for role in legs:
            if line.startswith(f"{prefix}{role}_legs_total{{"):
                legs[role][line.split('url="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[-1])
    label = f'{{mode="{mode}"}}'
    roles = ("prefill", "decode")
    return RouterReading(counter_total(text, f"{prefix}decode_imbalance_sum{label}"),
                         counter_total(text, f"{prefix}decode_imbalance_count{label}"), legs["decode"], legs["prefill"],
                         parse_step_time(text, f"{prefix}affinity_seconds"),
                         {r: counter_total(text, f'{prefix}prefix_prompt_tokens_total{{role="{r}"}}') for r in roles},
                         {r: counter_total(text, f'{prefix}prefix_held_tokens_total{{role="{r}"}}') for r in roles})


def legs_imbalance(before: dict[str, float], after: dict[str, float]) -> float | None:
    """Max over mean of the legs each instance was sent between two readings (1: even)."""
    sent = [after[url] - before.get(url, 0.0) for url in after]
    mean = sum(sent) / len(sent) if sent else 0.0
    return round(max(sent) / mean, 2) if mean > 0 else None


def held_share(before: RouterReading, after: RouterReading, role: str) -> float | None:
    """Of the prompt tokens routed knowing the prompt, the share the chosen ``role`` instance held."""
    tokens = after.prefix_tokens.get(role, 0.0) - before.prefix_tokens.get(role, 0.0)
    held = after.held_tokens.get(role, 0.0) - before.held_tokens.get(role, 0.0)
    return round(held / tokens, 3) if tokens > 0 else None


def mean_imbalance(before: RouterReading, after: RouterReading) -> float | None:
    count = after.imbalance_count - before.imbalance_count
    return round((after.imbalance_sum - before.imbalance_sum) / count, 2) if count > 0 else None


def prefill_ms(url: str, tokenizer: str, input_len: int, out_dir: Path, prompts: int = 5) -> float:
    """An instance's time to prefill one ``input_len``-token prompt, alone: the median latency of
    ``prompts`` one-token requests sent one at a time (the bench's P-capacity measurement)."""
    raw = bench_serve(url, tokenizer, Load(float("inf"), input_len, 1, prompts, max_concurrency=1, seed=7),
                      out_dir, f"prefill-capacity-in{input_len}")
    return float(raw["median_e2el_ms"])


#: ``churn``'s prompts average this share of the load's input length (10-99% of it).
CHURN_MEAN_SHARE = 0.55


def churn(url: str, tokenizer: str, load: Load, prompts: int, out_dir: Path, name: str) -> None:
    """Fragments the block pools behind ``url``: ``prompts`` requests whose prompts spread over 10-99%
    of ``load.input_len`` and outputs as widely under ``load.output_len`` (so each fits wherever the
    load fits), four at a time, so that they end out of order. vLLM frees a request's blocks tail
    first onto the back of its free queue and allocates from the front: once the pool has gone round,
    no request's blocks ascend, and every block of every layer is a descriptor of its own."""
    spread = Load(float("inf"), max(1, round(load.input_len * CHURN_MEAN_SHARE)), max(1, load.output_len // 2), prompts,
                  max_concurrency=4, range_ratio=0.8, seed=11)
    bench_serve(url, tokenizer, spread, out_dir, f"churn-{name}")


def pool_churn_prompts(model_dir: str, kv_cache_bytes: int, dtype_bytes: int, input_len: int) -> int:
    """How many of ``churn``'s requests (``CHURN_MEAN_SHARE`` of ``input_len`` on average) go round a KV
    pool of ``kv_cache_bytes`` one and a half times, from the model's config.json (8 where it cannot
    be read: a model name, not a directory)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        per_token = kv_bytes_per_token(config["num_hidden_layers"], config["num_key_value_heads"], head_dim, dtype_bytes)
    except (OSError, KeyError, ValueError, ZeroDivisionError):
        return 8
    return max(8, -(-3 * kv_cache_bytes // (2 * per_token * round(input_len * CHURN_MEAN_SHARE))))


def breakdown_between(directory: str, start: float, end: float,
                      split: Callable[[dict[str, float]], dict[str, float] | None] = timeline.breakdown
                      ) -> dict[str, float] | None:
    """The median of each of ``split``'s segments over the transfers that arrived at the router in
    [start, end] — the run's own requests, as runs never overlap."""
    parts = [b for events in timeline.load(directory).values()
             if start <= events.get("router_arrived", -1) <= end
             and (b := split(events)) is not None]
    if not parts:
        return None
    return {name: round(statistics.median(p[name] for p in parts) * 1e3, 2) for name in parts[0]}


WALL, CPU = "neuron_disagg_connector_step_seconds", "neuron_disagg_connector_step_cpu_seconds"
THREADS = {"prefill": {"push": "writer", "pull": "lender"}, "decode": {"push": "receiver", "pull": "reader"}}


@dataclass
class ConnectorReading:
    """What the bench reads from one instance's /metrics around a run: the connector's step
    histograms (``WALL``, ``CPU``), its transfer threads' CPU time (µs, by mode), and when."""

    steps: dict[str, StepTime]
    thread_cpu_us: dict[str, float]
    at: float  # monotonic
    descriptors: float = 0.0  # posted here: P's writes (push), D's reads (pull)
    transfers: float = 0.0  # completed here: P's writes, D's loads
    bytes: float = 0.0  # KV bytes posted here: P's writes, D's reads


def read_connector(url: str) -> ConnectorReading:
    """Our connector's readings from ``url`` (zeros where it exports none)."""
    at = time.monotonic()
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        text = ""
    return ConnectorReading({name: parse_step_time(text, name) for name in (WALL, CPU)},
                            {mode: counter_total(text, f"neuron_disagg_{mode}_thread_cpu_us_total")
                             for mode in ("push", "pull")}, at,
                            counter_total(text, "neuron_disagg_descriptors_total"),
                            counter_total(text, "neuron_disagg_transfers_total"),
                            counter_total(text, "neuron_disagg_bytes_total"))


def counter_total(text: str, name: str) -> float:
    """The samples of counter ``name`` in Prometheus text, summed over their labels."""
    return sum(float(line.rsplit(" ", 1)[-1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "))


def thread_cpu_percent(role: str, before: ConnectorReading, after: ConnectorReading) -> dict[str, float]:
    """Each transfer thread's CPU between the readings, as % of one core ("writer", "receiver"...)."""
    elapsed_us = (after.at - before.at) * 1e6
    if elapsed_us <= 0:
        return {}
    return {THREADS[role][mode]: round((after.thread_cpu_us[mode] - before.thread_cpu_us[mode]) / elapsed_us * 100, 2)
            for mode in ("push", "pull")}


def descriptors_per_transfer(p: tuple[ConnectorReading, ConnectorReading],
                             d: tuple[ConnectorReading, ConnectorReading]) -> float | None:
    """Descriptors posted between the readings (by P in push, by D in pull) per load D finished."""
    loads = d[1].transfers - d[0].transfers
    posted = (p[1].descriptors - p[0].descriptors) + (d[1].descriptors - d[0].descriptors)
    return round(posted / loads, 1) if loads > 0 else None


def parse_step_time(text: str, name: str = WALL) -> StepTime:
    """The histogram ``name`` in Prometheus text, summed over its labels."""
    total = StepTime()
    for line in text.splitlines():
        value = line.rsplit(" ", 1)[-1]
        if line.startswith(f"{name}_sum"):
            total.seconds += float(value)
        elif line.startswith(f"{name}_count"):
            total.steps += float(value)
        elif line.startswith(f"{name}_bucket") and 'le="' in line:
            bound = float(line.split('le="', 1)[1].split('"', 1)[0])
            total.buckets[bound] = total.buckets.get(bound, 0.0) + float(value)
    return total


def mean_step_us(before: StepTime, after: StepTime) -> float | None:
    steps = after.steps - before.steps
    return round((after.seconds - before.seconds) / steps * 1e6, 1) if steps > 0 else None


def step_quantile_us(before: StepTime, after: StepTime, q: float) -> float | None:
    """The histogram bucket bound (µs) at or below which a fraction ``q`` of the steps between the
    two readings fell: an upper bound on that quantile, as fine as the buckets (``stats.STEP_BUCKETS_S``:
    ... 50, 75, 100, 150, 200, 300 µs ...); inf when beyond the last."""
    steps = after.steps - before.steps
    if steps <= 0:
        return None
    for bound in sorted(after.buckets):
        if after.buckets[bound] - before.buckets.get(bound, 0.0) >= q * steps:
            return round(bound * 1e6, 1)
    return None


def scratch_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="neuron-disagg-bench-raw-"))
