"""`neuron-disagg bench`: monolithic vLLM, our push, our pull and vLLM's own NixlPushConnector and
NixlConnector, started locally one topology at a time and loaded with `vllm bench serve` over a grid
of request rates x input lengths; writes JSON, Markdown and PNG plots to a results directory and
prints each mode's ratio to the reference connector (vLLM's NixlConnector) and to monolithic, and
how far monolithic moved between the run's start and its end (the drift line). With ``--rounds N``
every topology stays up, the idle ones paused, and the modes run in N interleaved rounds
(``bench.rounds``): the drift then falls on every mode alike.

``--preset seed`` and ``--preset light`` set a named workload and judge the run by its goals
(``bench.preset``); flags given beside a preset override its settings.

Defaults fit a 2-core CPU machine (the tiny local model, a few minutes). On real hardware pass the
model, TP and the published workload, e.g. ``--model Qwen/Qwen3-32B --tp 8 --input-lens 16384
--output-len 128 --rates 2,4,8 --kv-cache-bytes 0``.
"""

from __future__ import annotations

import argparse
import shlex
import zlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..demo import tiny_model
from ..local_cluster import CPU_DTYPE
from .arglists import positive_list
from . import report
from .conversations import Conversations
from .load import (CPU, WALL, Load, RunResult, churn, descriptors_per_transfer,
                   heavy_tailed_dataset, held_share, legs_imbalance, mean_imbalance, mean_step_us, pool_churn_prompts,
                   prefill_ms, read_connector, read_router, run, scratch_dir, step_quantile_us, thread_cpu_percent)
from .preset import PRESETS, STOPPED, evaluate, rates_for
from .rounds import measure_in_rounds
from .topology import DEFAULT_MODES, MODES, Running, ServerSettings, groups, is_mode, is_ours, router_mode, started


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if not is_mode(m)]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown or text!r}; choose from {', '.join(MODES)} "
                                         "or push-bind-MS")
    return modes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="neuron-disagg bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="a named workload and the goals the run is judged by: " + "; ".join(
                       f"{name}: {preset.about}" for name, preset in sorted(PRESETS.items())))
    p.add_argument("--modes", type=_modes, default=list(DEFAULT_MODES),
                   help=f"comma-separated, of {', '.join(MODES)} and push-bind-MS (push binding D MS before P's "
                        f"predicted answer) (default {','.join(DEFAULT_MODES)}; the ray "
                        "modes serve through Ray Serve LLM, from an environment with Ray installed)")
    p.add_argument("--rates", type=positive_list(float, "--rates"), default=[1.0, 2.0],
                   help="request rates, req/s (default 1,2)")
    p.add_argument("--p-busy", type=positive_list(float, "--p-busy"), default=[],
                   help="instead of --rates: measure P's prefill time at each input length first, then send "
                        "requests at the rates that keep P busy this share of its time (e.g. 0.8)")
    p.add_argument("--churn", action="store_true",
                   help="before measuring each topology, fragment its KV block pools with requests of spread "
                        "lengths ending out of order, so that no transfer's blocks are contiguous")
    p.add_argument("--input-lens", type=positive_list(int, "--input-lens"), default=[512],
                   help="prompt lengths in tokens (default 512)")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per request (default 32)")
    p.add_argument("--prompts", type=int, default=16, help="requests per point (default 16)")
    p.add_argument("--decodes", type=int, default=1, help="D's per disaggregated topology, all on core 1 (default 1)")
    p.add_argument("--prefills", type=int, default=1, help="P's per topology of ours, all on core 0 (default 1)")
    p.add_argument("--conversations", type=int, default=0,
                   help="N > 0: instead of random prompts, N conversations of --turns turns each, every turn the "
                        "previous prompt, an answer of --output-len tokens and a new user message, after one shared "
                        "system prompt of --system-tokens (--input-lens then names the system prompt's length); "
                        "each mode and round has conversations of its own")
    p.add_argument("--turns", type=int, default=6, help="turns per conversation (default 6)")
    p.add_argument("--user-tokens", type=int, default=64, help="tokens of each user message (default 64)")
    p.add_argument("--hot-prefix", action="store_true",
                   help="with --conversations: one prefix for everything instead (each request the system prompt "
                        "and a message of its own)")
    p.add_argument("--heavy-tail", action="store_true",
                   help="output lengths Pareto-distributed from --output-len/16 up to --output-len (most short, a few "
                        "long) instead of all --output-len")
    p.add_argument("--stop-decode-s", type=float, default=0,
                   help="with --decodes 2 or more: measure each routed mode again ('MODE +stop') with its second D "
                        "stopped (SIGSTOP) this long, once 30%% of its requests were bound to a D")
    p.add_argument("--burstiness", type=float, default=1.0, help="1 = Poisson arrivals; <1 burstier")
    p.add_argument("--model", help="model path or name (default: the tiny local Qwen3, built once)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of every instance")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-bytes", type=int, default=256 << 20,
                   help="KV cache per instance (default 256 MiB for CPU); 0 leaves it to vLLM")
    p.add_argument("--block-size", type=int, default=32, help="KV block size (vLLM on CPU needs a multiple of 32)")
    p.add_argument("--dtype", help="vLLM's --dtype for every instance (default: float32 for the tiny model "
                   "on CPU, where vLLM's bf16 AMX kernels crashed; auto with --model)")
    p.add_argument("--vllm-args", default="",
                   help="more `vllm serve` flags for every instance, quoted (prefix caching is off unless "
                        "these say --enable-prefix-caching)")
    p.add_argument("--router-args", default="",
                   help="more `neuron-disagg router` flags for every routed mode, quoted (e.g. \"--health-interval-s 0.25\")")
    p.add_argument("--results", type=Path, help="results directory (default ./bench-results/<time>)")
    p.add_argument("--idle-seconds", type=float, default=10,
                   help="per topology, measure each instance's CPU over this long with nothing to do (0: skip)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the unmeasured pass per mode that absorbs kernel selection and NIXL handshakes")
    p.add_argument("--rounds", type=int, default=1,
                   help="N > 1: keep every topology up, the idle ones paused, and measure the modes in N "
                        "interleaved rounds, so the machine's drift falls on each alike; each point is the "
                        "median over the rounds (needs memory for every topology at once)")
    p.add_argument("--no-drift-check", action="store_true",
                   help="skip measuring monolithic again after the other topologies (the topologies run one "
                        "after another, and the machine's speed may move meanwhile: the drift line says how far)")
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The flags, a ``--preset``'s settings under any given explicitly."""
    p = parser()
    name = p.parse_known_args(argv)[0].preset
    if name:
        preset = PRESETS[name]
        p.set_defaults(input_lens=preset.input_lens, output_len=preset.output_len, prompts=preset.prompts,
                       rounds=preset.rounds, max_model_len=preset.max_model_len,
                       kv_cache_bytes=preset.kv_cache_bytes, p_busy=preset.p_busy, churn=preset.churn,
                       vllm_args=preset.vllm_args, router_args=preset.router_args, decodes=preset.decodes, heavy_tail=preset.heavy_tail,
                       stop_decode_s=preset.stop_decode_s, prefills=preset.prefills,
                       **({"conversations": preset.workload.conversations, "turns": preset.workload.turns,
                           "user_tokens": preset.workload.user_tokens, "hot_prefix": preset.workload.hot_prefix}
                          if preset.workload else {}),
                       **({"modes": list(preset.modes)} if preset.modes else {}),
                       **({"rates": preset.rates} if preset.rates else {}))
    args = p.parse_args(argv)
    given = {arg.split("=", 1)[0] for arg in (sys.argv[1:] if argv is None else argv)}
    if {"--rates", "--p-busy"} <= given:
        p.error("give --rates or --p-busy, not both")
    if "--rates" in given:  # beside a preset that sets P's share busy, the rates given win
        args.p_busy = []
    return args


def _terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    # SIGTERM (a supervisor's, a test's timeout) unwinds like an error, so every instance started
    # is stopped: each runs in a session of its own, which killing the bench alone would orphan.
    signal.signal(signal.SIGTERM, _terminated)
    preset = PRESETS.get(args.preset)
    if min(args.prompts, args.output_len, args.tp, args.rounds, args.decodes, args.prefills, args.turns) < 1:
        parser().error("--prompts, --output-len, --tp, --rounds, --decodes, --prefills and --turns must be at least 1")
    workload = (Conversations(args.conversations, args.turns, args.input_lens[0], args.user_tokens, args.output_len,
                              args.hot_prefix) if args.conversations else None)
    if workload is not None:
        if len(args.input_lens) > 1 or args.heavy_tail:
            parser().error("--conversations takes one --input-lens (the system prompt's) and no --heavy-tail")
        args.prompts = workload.requests
    if args.stop_decode_s < 0 or (args.stop_decode_s and args.decodes < 2):
        parser().error("--stop-decode-s needs --decodes 2 or more (the router must have another D to choose)")
    console = Console(width=None if sys.stdout.isatty() else 200)  # logs keep the whole table
    spec = tiny_model.KV_HEAVY if preset and preset.kv_heavy else tiny_model.SPEC
    model = args.model or str(tiny_model.build(spec=spec))
    # Prefix caching off: every point sends the same seeded prompts as the warm-up and the points
    # before it (and push and pull share one P and D), so with it on, all but the first pass
    # measured cache hits — one computed token instead of a prefill — in every mode alike.
    extra = (("--no-enable-prefix-caching", *shlex.split(args.vllm_args))
             + (("--tensor-parallel-size", str(args.tp)) if args.tp > 1 else ()))
    if args.max_model_len < (workload.longest if workload else max(args.input_lens)) + args.output_len:
        parser().error(f"--max-model-len {args.max_model_len} is shorter than the longest input plus output")
    dtype = args.dtype or ("auto" if args.model else CPU_DTYPE)
    server = ServerSettings(model, args.max_model_len, args.kv_cache_bytes, args.block_size, extra, dtype,
                            args.decodes, args.prefills, tuple(shlex.split(args.router_args)))
    out_dir = args.results or Path("bench-results") / time.strftime("%Y%m%d-%H%M%S")
    raw_dir = scratch_dir()
    datasets = {n: heavy_tailed_dataset(model, n, args.output_len, args.prompts, raw_dir / f"heavy-tail-in{n}.jsonl",
                                        least=max(8, args.output_len // 16))
                for n in args.input_lens} if args.heavy_tail else {}

    def load(rate: float, n: int) -> Load:
        return Load(rate, n, args.output_len, args.prompts, args.burstiness, dataset=datasets.get(n), workload=workload)

    # With --p-busy the rates come from P's prefill time, measured on the first topology up.
    loads = [] if args.p_busy else [load(rate, n) for n in args.input_lens for rate in args.rates]
    meta = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "model": model, "tp": args.tp,
            "prompts": args.prompts, "output_len": args.output_len, "burstiness": args.burstiness,
            "rates": args.rates if not args.p_busy else None, "p_busy": args.p_busy, "preset": args.preset,
            "input_lens": args.input_lens, "modes": args.modes, "rounds": args.rounds, "churn": args.churn,
            "kv_cache_bytes": args.kv_cache_bytes, "block_size": args.block_size, "decodes": args.decodes, "router_args": args.router_args,
            "heavy_tail": args.heavy_tail, "stop_decode_s": args.stop_decode_s, "prefills": args.prefills,
            "workload": vars(workload) if workload else None,
            "vllm_args": list(extra), "raw": str(raw_dir), "idle_seconds": args.idle_seconds}
    churn_prompts = (pool_churn_prompts(model, args.kv_cache_bytes, 4 if dtype == "float32" else 2,
                                        max(args.input_lens)) if args.churn else 0)
    results: list[RunResult] = []
    recheck = (args.rounds == 1 and not args.no_drift_check and "monolithic" in args.modes
               and len(groups(args.modes)) > 1)  # rounds put the drift on every mode instead
    scenarios = 2 if args.stop_decode_s else 1
    points = (len(args.modes) * args.rounds * scenarios + recheck) * len(args.input_lens) * len(args.p_busy or args.rates)
    warmup = not args.no_warmup
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("starting", total=points)

        def on_start(group, topo) -> None:
            if args.p_busy and not loads:  # P's capacity: on P's core, alone, before any load
                url = topo.prefill.url if topo.prefill else topo.urls["monolithic"]
                progress.update(task, description=f"measuring P's prefill time on {' + '.join(group)}")
                with _paused(list(topo.routers.values())):  # their checks would take P's core
                    meta["p_prefill_ms"] = {n: prefill_ms(url, model, n, raw_dir) for n in args.input_lens}
                loads.extend(load(rate, n) for n in args.input_lens
                             for rate in rates_for(args.p_busy, meta["p_prefill_ms"][n]))
                meta["rates"] = sorted({load.rate for load in loads})
                console.print("P's prefill alone: " + ", ".join(
                    f"{ms:.0f} ms at {n} tokens" for n, ms in meta["p_prefill_ms"].items())
                    + f"; rates {meta['rates']} req/s keep it {', '.join(f'{b:.0%}' for b in args.p_busy)} busy")
            meta.setdefault("reniced_spinning_threads", {}).update(topo.reniced)
            meta.setdefault("idle_cpu_percent", {})[" + ".join(group)] = topo.idle_cpu
            if any(topo.reniced.values()):
                console.print(f"{' + '.join(group)}: reniced threads spinning while idle: {topo.reniced}")

        def start_failed(group, exc) -> list[RunResult]:
            console.print(f"[red]{' + '.join(group)} did not start:[/] {exc}")
            points = loads or [Load(0.0, n, args.output_len, args.prompts) for n in args.input_lens]  # rates unknown yet
            progress.advance(task, len(group) * len(points) * args.rounds)
            return [RunResult(mode, load.rate, load.input_len, load.output_len, load.prompts,
                              error=f"did not start: {str(exc).splitlines()[0]}") for mode in group for load in points]

        def measure(group, topo, round_index: int) -> list[RunResult]:  # warm-up in the first round only
            raw = raw_dir / f"round-{round_index + 1}" if args.rounds > 1 else raw_dir
            first = round_index == 0
            return _measure(group, topo, loads, model, raw, warmup and first, progress, task,
                            churn_prompts if first else 0, args.stop_decode_s, f"round{round_index + 1}")

        if args.rounds > 1:
            progress.update(task, description="starting every topology")
            results = measure_in_rounds(groups(args.modes), server, args.rounds, measure, start_failed,
                                        args.idle_seconds, on_start)
        else:
            for group in groups(args.modes):
                progress.update(task, description=f"starting {' + '.join(group)}")
                try:
                    with started(group, server, idle_window_s=args.idle_seconds) as topo:
                        on_start(group, topo)
                        results += measure(group, topo, 0)
                except (RuntimeError, TimeoutError) as exc:  # one topology failing to start: the rest still run
                    results += start_failed(group, exc)
        again = _measure_again(server, loads, model, raw_dir, warmup, progress, task) if recheck else []
    if again:
        meta["drift"] = report.drift(results, again)
    for r in results:
        if meta.get("p_prefill_ms") and r.rate:
            r.p_busy = round(r.rate * meta["p_prefill_ms"][r.input_len] / 1000, 2)
    if preset:
        meta["goals"] = evaluate(preset.goals, results)
    written = report.write(results, meta, out_dir)
    _print(console, results)
    if meta.get("goals"):
        console.print(report.goals_text(meta["goals"], args.preset))
    if meta.get("idle_cpu_percent"):
        console.print(report.idle_line(meta["idle_cpu_percent"], args.idle_seconds))
    if meta.get("drift"):
        console.print(report.drift_line(meta["drift"]))
    console.print("\n" + "\n".join(f"wrote {p}" for p in written))
    return 0 if all(r.error is None and r.failed == 0 for r in results + again) else 1


def _measure_again(server, loads, model, raw_dir, warmup, progress, task) -> list[RunResult]:
    """Monolithic once more, after every other topology: its points against the first ones say how
    far the machine's speed moved during the run."""
    progress.update(task, description="starting monolithic again (drift)")
    try:
        with started(("monolithic",), server) as topo:
            return _measure(("monolithic",), topo, loads, model, raw_dir / "again", warmup, progress, task)
    except (RuntimeError, TimeoutError) as exc:
        error = f"did not start: {str(exc).splitlines()[0]}"
        return [RunResult("monolithic", load.rate, load.input_len, load.output_len, load.prompts, error=error)
                for load in loads]


def _measure(group, topo, loads, model, raw_dir, warmup, progress, task, churn_prompts: int = 0,
             stop_decode_s: float = 0, tag: str = "") -> list[RunResult]:
    out = []
    for mode in group:
        # The modes sharing these instances each have a router, which checks every instance as often
        # as the measured one: paused meanwhile, so P and D serve one router's checks, as alone.
        with _paused([r for m, r in topo.routers.items() if m != mode]):
            out += _measure_mode(mode, topo, loads, model, raw_dir, warmup, progress, task,
                                 churn_prompts if mode == group[0] else 0, stop_decode_s, tag)
    return out


def _measure_mode(mode, topo, loads, model, raw_dir, warmup, progress, task, churn_prompts: int,
                  stop_decode_s: float, tag: str = "") -> list[RunResult]:
    out = []
    url = topo.urls[mode]

    def own(load: Load, what: str) -> Load:
        """``load`` with conversations of this mode's own (none shared with another mode or round:
        they run on the same instances, whose caches would hold each other's)."""
        return replace(load, seed=zlib.crc32(f"{mode}/{tag}/{what}".encode())) if load.workload else load

    if churn_prompts:  # one churn per topology: its modes share P's and D's pools
        progress.update(task, description=f"{mode}: churning the block pools")
        churn(url, model, loads[-1], churn_prompts, raw_dir / "churn", mode)
    if warmup:
        progress.update(task, description=f"{mode}: warm-up")
        run(mode, url, model, own(loads[-1], "warmup"), raw_dir / "warmup")
    stopping = (False, True) if stop_decode_s and len(topo.decodes) > 1 else (False,)
    for load in loads:
        for stop in stopping:
            progress.update(task, description=f"{mode}{STOPPED if stop else ''}: {load.rate} req/s, "
                                              f"input {load.input_len}")
            out.append(_measure_one(mode, topo, url, model, own(load, f"{load.rate}{STOPPED if stop else ''}"),
                                    raw_dir, stop_decode_s if stop else 0))
            progress.advance(task)
    return out


@contextmanager
def _paused(processes: list) -> Iterator[None]:
    for process in processes:
        process.pause()
    try:
        yield
    finally:
        for process in processes:
            process.resume()


def _measure_one(mode: str, topo: Running, url: str, model: str, load: Load, raw_dir: Path,
                 stop_decode_s: float) -> RunResult:
    """One run of ``mode`` at ``load``, with what the connector and the router say around it; with
    ``stop_decode_s``, the second D is stopped that long once 30% of the requests were bound, and the
    result is labelled ``MODE +stop``."""
    ours = is_ours(mode)  # only our connector exports these
    routed = mode != "monolithic" and not mode.startswith("ray-")
    p_url, d_url = (topo.prefill.url, topo.decodes[0].url) if ours else ("", "")
    before = (read_connector(p_url), read_connector(d_url)) if ours else None
    movers = [i.url for i in (*topo.prefills, *topo.decodes)] if ours else []  # every P and D: the KV bytes posted
    moved_before = sum(read_connector(u).bytes for u in movers)
    routed_before = read_router(url, router_mode(mode)) if routed else None
    stopper = _DecodeStopper(topo.decodes[1], url, router_mode(mode), max(1, round(0.3 * load.prompts)),
                             stop_decode_s) if stop_decode_s else None
    try:
        result = run(mode, url, model, load, raw_dir / ("stop" if stopper else ""), topo.timeline_dir)
    finally:
        if stopper:
            stopper.join()
    if stopper:
        result.mode = f"{mode}{STOPPED}"
        result.stopped_d_binds = stopper.binds
    if routed_before:
        routed_after = read_router(url, router_mode(mode))
        result.decode_imbalance = mean_imbalance(routed_before, routed_after)
        result.decode_legs_imbalance = legs_imbalance(routed_before.decode_legs, routed_after.decode_legs)
        if len(routed_after.prefill_legs) > 1:
            result.prefill_legs_imbalance = legs_imbalance(routed_before.prefill_legs, routed_after.prefill_legs)
        result.prefill_held_share = held_share(routed_before, routed_after, "prefill")
        result.decode_held_share = held_share(routed_before, routed_after, "decode")
        p99 = step_quantile_us(routed_before.affinity, routed_after.affinity, 0.99)
        result.affinity_p99_ms = None if p99 is None else round(p99 / 1e3, 2)
    if movers and result.completed:
        result.kv_bytes_per_request = round((sum(read_connector(u).bytes for u in movers) - moved_before) / result.completed)
    if before:
        result.thread_cpu_percent = {}
        after = (read_connector(p_url), read_connector(d_url))
        result.descriptors_per_transfer = descriptors_per_transfer((before[0], after[0]), (before[1], after[1]))
        for side, earlier, later in (("prefill", before[0], after[0]), ("decode", before[1], after[1])):
            setattr(result, f"{side}_step_us", mean_step_us(earlier.steps[WALL], later.steps[WALL]))
            for series, clock in (("step", WALL), ("step_cpu", CPU)):
                for q in (50, 99):
                    setattr(result, f"{side}_{series}_p{q}_us",
                            step_quantile_us(earlier.steps[clock], later.steps[clock], q / 100))
            result.thread_cpu_percent.update(
                {f"{side[0].upper()} {thread}": pct
                 for thread, pct in thread_cpu_percent(side, earlier, later).items()})
    return result


class _DecodeStopper(threading.Thread):
    """Once the router at ``router_url`` has bound ``after_legs`` D legs more than when it started
    (the run is under way: `vllm bench serve` takes seconds to start sending), stops ``decode``
    (SIGSTOP of its whole process group) for ``for_s``, and counts the D legs the router sent it
    meanwhile (``binds``): requests bound to a D after it stopped."""

    def __init__(self, decode, router_url: str, mode: str, after_legs: int, for_s: float, timeout_s: float = 600):
        super().__init__(name="bench-decode-stopper", daemon=True)
        self.decode, self.router_url, self.mode = decode, router_url, mode
        self.after_legs, self.for_s, self.timeout_s = after_legs, for_s, timeout_s
        self.binds: int | None = None
        self.start()

    def _legs(self) -> dict[str, float]:
        return read_router(self.router_url, self.mode).decode_legs

    def run(self) -> None:
        start = sum(self._legs().values())
        deadline = time.monotonic() + self.timeout_s
        while sum(self._legs().values()) < start + self.after_legs:
            if time.monotonic() > deadline:
                return  # the run never got that far: nothing stopped, nothing counted
            time.sleep(0.05)
        before = self._legs().get(self.decode.url, 0.0)
        self.decode.pause()
        try:
            time.sleep(self.for_s)
            self.binds = int(self._legs().get(self.decode.url, 0.0) - before)
        finally:
            self.decode.resume()


def _print(console: Console, results: list[RunResult]) -> None:
    header, *body = report.table(results)
    t = Table(title="neuron-disagg bench (ratios measured side by side in this run)")
    for title in header:
        t.add_column(title, justify="left" if title == "mode" else "right")
    for row in body:
        t.add_row(*row)
    console.print(t)
    for r in results:
        if r.p_and_after_ms:
            console.print(f"{r.mode} {r.rate} req/s in {r.input_len}: until P answered "
                          f"{r.p_and_after_ms['until_p_answered']:.1f} ms, after {r.p_and_after_ms['after_p_answered']:.1f} ms")
        if r.breakdown_ms:
            console.print(f"{r.mode} {r.rate} req/s in {r.input_len}: TTFT p50 segments "
                          + ", ".join(f"{k} {v:.1f}" for k, v in r.breakdown_ms.items() if k != "ttft") + " ms")
        if r.thread_cpu_percent:
            console.print(report.thread_line(r))
        if r.error:
            console.print(f"[red]{r.mode} {r.rate} req/s in {r.input_len}: {r.error}[/]")
