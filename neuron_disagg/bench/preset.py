"""Named workloads for `neuron-disagg bench --preset NAME`, and the goals each is judged by.

- ``seed``: the regime the seed's claim is about, scaled to a 2-core machine. Long prompts into a
  model whose KV is large for its compute (``tiny_model.KV_HEAVY``: 64 layers over a thin residual
  stream, so a prompt's KV is thousands of block-by-layer pieces), P kept busy (the rate is set
  from P's measured prefill time), the block pools churned first so that no transfer's blocks are
  contiguous, and every mode in interleaved rounds.
- ``seed-long``: the seed point at 8,160 tokens (the tiny model's longest), fewer prompts and rounds (a prefill takes seconds
  here), streamed push beside push writing at the end and vLLM's NixlConnector.
- ``shift``: shifting decode load. 1P2D, output lengths heavy-tailed (most answers short, a few
  long) so the two D's loads diverge, and a second scenario per mode (``<mode> +stop``) in which one
  D is stopped (SIGSTOP) for a few seconds mid-run. Push bound at arrival against push bound late
  (``push-bind-MS``) and the pull modes, which choose D when P answers.
- ``multiturn``: conversations over 2P2D with the prefix cache on: each mode routed by load alone
  against the same mode routed by what each instance holds (``-cache``), push, pull and two
  monolithic instances behind the router. ``hot-prefix``: the same with one prefix for everything.
- ``light``: the light corner (512 tokens at 1 and 2 req/s, the default tiny model), where the goals
  are about what push costs over monolithic rather than its lead.

A goal compares figures of one point (rate x input length) of one run; ``evaluate`` says, point by
point, what was measured against what was asked. Pure functions: nothing here starts anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable

from .conversations import Conversations
from .load import RunResult
from .topology import DEFAULT_MODES

Point = dict[str, RunResult]  # mode -> its result at one (rate, input length)


@dataclass(frozen=True)
class Goal:
    """``text`` in words; ``measure`` gives (measured, bound) at a point, None where a figure is missing."""

    text: str
    measure: Callable[[Point], tuple[float, float] | None]


@dataclass(frozen=True)
class Preset:
    name: str
    about: str
    input_lens: list[int]
    output_len: int
    prompts: int
    rounds: int
    max_model_len: int
    kv_cache_bytes: int
    rates: list[float] = field(default_factory=list)  # empty: from P's measured capacity and p_busy
    p_busy: list[float] = field(default_factory=list)
    kv_heavy: bool = False  # the KV-heavy tiny model (tiny_model.KV_HEAVY) instead of the default
    churn: bool = False
    vllm_args: str = ""  # more `vllm serve` flags, for every mode alike
    router_args: str = ""  # more `neuron-disagg router` flags, for every routed mode alike
    modes: tuple[str, ...] = ()  # empty: the bench's default modes
    decodes: int = 1  # D's per disaggregated topology
    heavy_tail: bool = False  # output lengths Pareto-distributed up to output_len, not all output_len
    stop_decode_s: float = 0  # > 0: each mode again with its second D stopped this long mid-run
    prefills: int = 1  # P's per topology of ours
    workload: Conversations | None = None  # conversations instead of random prompts (input_lens: the system prompt's)
    goals: tuple[Goal, ...] = ()


def _figure(point: Point, mode: str, name: str) -> float | None:
    result = point.get(mode)
    value = getattr(result, name) if result is not None and result.error is None else None
    return value if value else None


def ratio_goal(mode: str, name: str, base: str, bound: float, words: str) -> Goal:
    """``mode``'s ``name`` at most ``bound`` times ``base``'s."""
    def measure(point: Point):
        value, reference = _figure(point, mode, name), _figure(point, base, name)
        return (value / reference, bound) if value and reference else None
    return Goal(f"{mode} {words} <= {bound:g}x {base}", measure)


def handoff_goal(mode: str, base: str, bound: float) -> Goal:
    """``mode``'s time from P's answer to D's first byte (p50) at most ``bound`` times ``base``'s."""
    def after(point: Point, m: str) -> float | None:
        result = point.get(m)
        ok = result is not None and result.error is None and result.p_and_after_ms
        return result.p_and_after_ms.get("after_p_answered") if ok else None

    def measure(point: Point):
        value, reference = after(point, mode), after(point, base)
        return (value / reference, bound) if value and reference else None
    return Goal(f"{mode} hand-off after P answered (p50) <= {bound:g}x {base}", measure)


def push_tax_goal() -> Goal:
    """What push adds over monolithic, less vLLM's own idle sleep before D schedules the request,
    within one D decode step plus the write plus 1 ms."""
    def measure(point: Point):
        push, mono = _figure(point, "push", "ttft_p50_ms"), _figure(point, "monolithic", "ttft_p50_ms")
        tpot, parts = _figure(point, "push", "tpot_p50_ms"), point["push"].breakdown_ms if "push" in point else None
        if not (push and mono and tpot and parts and "write" in parts and "to_d_step" in parts):
            return None
        return push - mono - parts["to_d_step"], tpot + parts["write"] + 1.0
    return Goal("push TTFT p50 - monolithic's - to_d_step <= D's decode step (TPOT p50) + write + 1 ms, in ms",
                measure)


def step_cpu_goal(mode: str, side: str, bound_us: float) -> Goal:
    """Our connector's CPU on the engine thread per step, p99 (a histogram bucket's bound)."""
    def measure(point: Point):
        value = _figure(point, mode, f"{side}_step_cpu_p99_us")
        return (value, bound_us) if value is not None else None
    return Goal(f"{mode}: connector CPU per {side} engine step p99 <= {bound_us:g} us", measure)


SEED = Preset(
    name="seed", about="long prompts into a KV-heavy model, P kept busy, fragmented KV, modes interleaved",
    input_lens=[2048], output_len=32, prompts=32, rounds=3, max_model_len=2560, kv_cache_bytes=768 << 20,
    p_busy=[0.8], kv_heavy=True, churn=True,
    # Every engine computes a 2,048-token prompt in four steps of 512, as a server under load
    # chunks long prompts: push streams the first three while the fourth runs, push-layers the
    # fourth too, group of layers by group as its forward writes them.
    vllm_args="--max-num-batched-tokens 512",
    goals=(ratio_goal("push", "ttft_p50_ms", "vllm-pull", 0.5, "TTFT p50"),
           handoff_goal("push", "vllm-pull", 0.3),
           ratio_goal("push", "ttft_p50_ms", "vllm-push", 0.9, "TTFT p50"),
           ratio_goal("push", "tpot_p50_ms", "vllm-pull", 0.8, "TPOT p50"),
           ratio_goal("pull", "ttft_p50_ms", "vllm-pull", 0.8, "TTFT p50"),
           ratio_goal("push-bind-0", "ttft_p50_ms", "push", 1.05, "TTFT p50")),
    modes=(*DEFAULT_MODES, "push-layers", "push-bind-0"))

LIGHT = Preset(
    name="light", about="the light corner: short prompts, light load, the default tiny model",
    input_lens=[512], output_len=32, prompts=16, rounds=3, max_model_len=2048, kv_cache_bytes=256 << 20,
    rates=[1.0, 2.0], modes=(*DEFAULT_MODES, "push-bind-0"),
    goals=(ratio_goal("push", "ttft_p50_ms", "vllm-pull", 0.8, "TTFT p50"),
           ratio_goal("push", "ttft_p50_ms", "vllm-push", 0.8, "TTFT p50"),
           ratio_goal("push", "ttft_p99_ms", "vllm-pull", 0.25, "TTFT p99"),
           ratio_goal("push", "ttft_p99_ms", "vllm-push", 0.25, "TTFT p99"),
           push_tax_goal(),
           ratio_goal("push-bind-0", "ttft_p50_ms", "push", 1.05, "TTFT p50"),
           *(step_cpu_goal(mode, side, 100) for mode in ("push", "pull") for side in ("prefill", "decode"))))

SEED_LONG = Preset(
    name="seed-long", about="the seed point at 8,160 tokens: what streaming keeps of the hand-off as prompts grow",
    # 8,160 + 32 output tokens: the tiny model's 8,192 positions, the longest it holds
    input_lens=[8160], output_len=32, prompts=4, rounds=2, max_model_len=8192, kv_cache_bytes=768 << 20,
    p_busy=[0.8], kv_heavy=True, vllm_args="--max-num-batched-tokens 512",
    modes=("push", "push-layers", "push-whole", "vllm-pull"),
    goals=(handoff_goal("push", "vllm-pull", 0.3),))

def at_most_goal(mode: str, name: str, bound: float, words: str) -> Goal:
    """``mode``'s ``name`` at most ``bound`` (a count: 0 is a figure here, not a missing one)."""
    def measure(point: Point):
        result = point.get(mode)
        value = getattr(result, name) if result is not None and result.error is None else None
        return (value, bound) if value is not None else None
    return Goal(f"{mode} {words} <= {bound:g}", measure)


#: The horizons the shifting-load preset binds D at: at P's answer, and 100 ms before its prediction.
LATE = ("push-bind-0", "push-bind-100")
STOPPED = " +stop"  # a mode's label in the scenario with one D stopped

SHIFT = Preset(
    name="shift", about="shifting decode load: 1P2D, heavy-tailed outputs, and one D stopped mid-run",
    # P half busy, so that its queue does not drown what the D's do; answers of 32-512 tokens, so
    # that the D's hold several sequences each and the long ones pile up on one.
    input_lens=[1024], output_len=512, prompts=40, rounds=2, max_model_len=2048, kv_cache_bytes=512 << 20,
    p_busy=[0.5], decodes=2, heavy_tail=True, stop_decode_s=3.0,
    # A P here answers within a second of arrival: a stopped D must be seen silent well within that.
    router_args="--health-interval-s 0.25 --decode-silent-s 0.5",
    modes=("push", *LATE, "pull", "vllm-push", "vllm-pull"),
    goals=(*(g for late in LATE for g in (
        ratio_goal(late, "ttft_p99_ms", "pull", 1.0, "TTFT p99"),
        ratio_goal(late, "tpot_p99_ms", "pull", 1.0, "TPOT p99"),
        ratio_goal(late, "ttft_p99_ms", "push", 0.8, "TTFT p99"),
        ratio_goal(late, "tpot_p99_ms", "push", 0.8, "TPOT p99"),
        at_most_goal(late + STOPPED, "stopped_d_binds", 0, "D legs bound to the stopped D"),
        ratio_goal(late + STOPPED, "ttft_p99_ms", late, 1.5, "TTFT p99"))),))

#: Routed by what instances hold, and by load alone: push, pull and two monolithic instances.
CACHED = ("push-cache", "pull-cache", "mono2-cache")
_CONVERSATIONS = dict(
    # 9 conversations (odd: routed by load alone, consecutive requests alternate between two P's, and
    # a conversation's turns, 9 requests apart, do not keep to one P by accident), 6 turns each,
    # a 256-token system prompt, 64-token messages and answers: the last turn is 960 tokens.
    input_lens=[256], output_len=64, prompts=54, rounds=2, max_model_len=2048, kv_cache_bytes=256 << 20,
    rates=[2.0], vllm_args="--enable-prefix-caching", decodes=2, prefills=2,
    modes=("push", "push-cache", "pull", "pull-cache", "mono2", "mono2-cache"))
_BALANCED = tuple(g for mode in CACHED for g in (
    at_most_goal(mode, "decode_legs_imbalance", 1.3, "legs max/mean over its D's"),
    at_most_goal(mode, "affinity_p99_ms", 2.0, "router's match time per request p99, ms"))) + tuple(
    at_most_goal(mode, "prefill_legs_imbalance", 1.3, "legs max/mean over its P's") for mode in CACHED[:2])

MULTITURN = Preset(
    name="multiturn", about="conversations on 2P2D, prefix cache on: routed by what instances hold against by load",
    workload=Conversations(9, 6, 256, 64, 64), **_CONVERSATIONS,  # type: ignore[arg-type]
    goals=(*(g for mode in ("push", "pull") for g in (
        ratio_goal(f"{mode}-cache", "ttft_p50_ms", mode, 0.5, "TTFT p50"),
        ratio_goal(f"{mode}-cache", "kv_bytes_per_request", mode, 0.4, "KV bytes per request"))),
        *_BALANCED))

HOT_PREFIX = Preset(
    name="hot-prefix", about="one prefix for everything on 2P2D: what routing by what instances hold does to balance",
    workload=Conversations(9, 6, 256, 64, 64, hot_prefix=True), **_CONVERSATIONS,  # type: ignore[arg-type]
    goals=_BALANCED)

PRESETS = {p.name: p for p in (SEED, SEED_LONG, LIGHT, SHIFT, MULTITURN, HOT_PREFIX)}


def rates_for(p_busy: list[float], prefill_ms: float) -> list[float]:
    """Request rates that keep P busy for each fraction of its time, one prefill taking ``prefill_ms``."""
    return [round(busy * 1000.0 / prefill_ms, 2) for busy in p_busy]


def evaluate(goals: tuple[Goal, ...], results: list[RunResult]) -> list[dict]:
    """Every goal at every point of ``results``: measured, bound, met (None: a figure was missing)."""
    points: dict[tuple[float, int], Point] = {}
    for r in results:
        points.setdefault((r.rate, r.input_len), {})[r.mode] = r
    out = []
    for (rate, input_len), point in points.items():
        for goal in goals:
            got = goal.measure(point)
            out.append({"goal": goal.text, "rate": rate, "input_len": input_len,
                        "measured": None if got is None else round(got[0], 2),
                        "bound": None if got is None else round(got[1], 2),
                        "met": None if got is None else got[0] <= got[1]})
    return out
