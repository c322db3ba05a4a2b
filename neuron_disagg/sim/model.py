"""One simulated run: a router in front of x prefill and y decode instances, in push, pull, or
prefill-only mode, fed by one arrival stream. ``simulate`` returns every request's record.

The two transfer paths, as modelled (each arrow is a delay or a queue in the model):

push  arrival -> router -> P tokenizes -> P queue -> prefill ........................ kv ready --+
              -> router -> D tokenizes -> D boundary: allocate, register -> side channel --------+-> rendezvous
              -> P writer thread: plan + post (off both loops) -> wire -> notification
              -> D sees it at its next step boundary (+ sched_lag_steps) -> first decode step -> first token
pull  arrival -> router -> P tokenizes -> P queue -> prefill -> P answers router -> router -> D tokenizes again
              -> D boundary: allocate, build + post descriptors ON D'S LOOP -> wire (READ)
              -> D sees completion at its next boundary (+ sched_lag_steps) -> first decode step -> first token
none  arrival -> router -> P tokenizes -> P queue -> prefill = first token (for queueing checks)

P holds the prompt's blocks (its lease) until the KV has left: push until the write completes,
pull until D's read-done notice arrives — and then until the end of P's step in flight (plus
sched_lag_steps), because vLLM's P frees them from its own engine loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import simpy

from .decode import DecodeInstance
from .errors import ScenarioError
from .fabric import Fabric
from .params import Profile
from .prefill import PrefillInstance
from .records import Record
from .steptime import descriptors, push_writer_s
from .workload import RequestSpec, requests

MODES = ("push", "pull", "none")


@dataclass(frozen=True)
class Scenario:
    mode: str
    rate: float
    input_len: int
    output_len: int = 128
    requests: int = 400
    seed: int = 0
    burstiness: float = 1.0
    num_p: int = 1
    num_d: int = 1
    chunk_tokens: int | None = None
    max_batch_tokens: int | None = None
    max_batch_requests: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ScenarioError(f"mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.num_p < 1 or self.num_d < 1:
            raise ScenarioError(f"need at least one P and one D, got {self.num_p}P{self.num_d}D")
        if self.chunk_tokens is not None and self.chunk_tokens < 1:
            raise ScenarioError(f"chunk_tokens must be >= 1 or None (no chunking), got {self.chunk_tokens}")
        for name in ("max_batch_tokens", "max_batch_requests"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ScenarioError(f"{name} must be >= 1 or None (unlimited), got {value}")


@dataclass
class RunResult:
    scenario: Scenario
    profile: Profile
    records: list[Record]
    end_s: float
    d_loop_busy_s: float
    d_steps: int
    leaks: list[str]  # KV pools not back at full capacity once every request is done (must be empty)
    p_peak_blocks: int = 0  # most KV blocks any P held at once (0 when P's pool is unlimited)


class _Run:
    def __init__(self, profile: Profile, scenario: Scenario) -> None:
        self.profile, self.sc = profile, scenario
        self.env = simpy.Environment()
        env = self.env
        self.fabric = Fabric(env, profile, scenario.num_p, scenario.num_d)
        self.p = [PrefillInstance(env, i, profile, on_kv_ready=self._kv_ready, chunk_tokens=scenario.chunk_tokens,
                                  max_batch_tokens=scenario.max_batch_tokens,
                                  max_batch_requests=scenario.max_batch_requests) for i in range(scenario.num_p)]
        self.d = [DecodeInstance(env, i, profile, mode=scenario.mode, on_admitted=self._admitted)
                  for i in range(scenario.num_d)]
        self.p_front = [simpy.Resource(env, capacity=1) for _ in range(scenario.num_p)]
        self.d_front = [simpy.Resource(env, capacity=1) for _ in range(scenario.num_d)]
        self.kv_ready: set[int] = set()
        self.registered: set[int] = set()
        self.records: list[Record] = []

    # -- router ------------------------------------------------------------------------------
    def _pick(self, instances, load) -> int:
        """Least loaded, lowest index on ties: deterministic, and what a push-aware router does."""
        return min(range(len(instances)), key=lambda i: (load(instances[i]), i))

    def _arrivals(self, specs: list[RequestSpec]):
        env, hop = self.env, self.profile.v("router_hop_s")
        for spec in specs:
            yield env.timeout(spec.arrival_s - env.now)
            record = Record(spec)
            self.records.append(record)
            p = self._pick(self.p, lambda x: x.outstanding)
            env.process(self._deliver(hop, self.p_front[p], self.p[p].submit, record))
            if self.sc.mode == "push":  # D is chosen now and gets its leg at once
                d = self._pick(self.d, lambda x: x.assigned)
                record.d_index = d
                self.d[d].assigned += 1
                env.process(self._deliver(hop, self.d_front[d], self.d[d].arrive, record))

    def _deliver(self, delay: float, front: simpy.Resource, fn, record: Record):
        """A hop to an instance, then its API server tokenizes the text prompt (one thread: FIFO)."""
        yield self.env.timeout(delay)
        with front.request() as turn:
            yield turn
            yield self.env.timeout(record.spec.input_len * self.profile.v("frontend_s_per_token"))
        fn(record)

    def _after(self, delay: float, fn, *args):
        yield self.env.timeout(delay)
        fn(*args)

    # -- P finished a prompt -------------------------------------------------------------------
    def _kv_ready(self, record: Record) -> None:
        mode, rid = self.sc.mode, record.spec.rid
        if mode == "none":
            record.first_token_s = record.prefill_end_s
            self.p[record.p_index].release(record)
            record.finish(self.env.now)
        elif mode == "push":
            self.kv_ready.add(rid)
            if rid in self.registered:
                self.env.process(self._write(record))
        else:  # pull: P answers the router, which relays to D, whose front end tokenizes again
            d = self._pick(self.d, lambda x: x.assigned)
            record.d_index = d
            self.d[d].assigned += 1
            relay = 2 * self.profile.v("router_hop_s")  # P -> router -> D, then D tokenizes again
            self.env.process(self._deliver(relay, self.d_front[d], self.d[d].arrive, record))

    # -- D admitted a request at a step boundary, ``work_s`` into that boundary's work -----------
    def _admitted(self, record: Record, work_s: float) -> None:
        if self.sc.mode == "push":
            self.env.process(self._after(work_s + self.profile.v("side_channel_s"), self._registration, record))
        else:
            self.env.process(self._read(record, work_s))

    def _registration(self, record: Record) -> None:
        record.registered_s = self.env.now
        self.registered.add(record.spec.rid)
        if record.spec.rid in self.kv_ready:
            self.env.process(self._write(record))

    def _write(self, record: Record):
        """Push: P's writer thread plans and posts, the fabric carries, D is notified."""
        p = self.p[record.p_index]
        record.descriptors = descriptors(self.profile, record.spec.input_len)
        with p.writer.request() as turn:
            yield turn
            yield self.env.timeout(push_writer_s(self.profile, record.spec.input_len))
        record.transfer_start_s = self.env.now
        yield from self.fabric.move(record.p_index, record.d_index, record.spec.input_len)
        p.release(record)  # P's local completion ends its lease
        yield self.env.timeout(self.profile.v("notify_s"))
        self.d[record.d_index].kv_loaded(record)

    def _read(self, record: Record, posted_after_s: float):
        """Pull: the READ starts once D's loop has posted it, then D tells P it may free."""
        record.descriptors = descriptors(self.profile, record.spec.input_len)
        yield self.env.timeout(posted_after_s)
        record.transfer_start_s = self.env.now
        yield from self.fabric.move(record.p_index, record.d_index, record.spec.input_len)
        self.d[record.d_index].kv_loaded(record)
        self.env.process(self._after(self.profile.v("notify_s"), self.p[record.p_index].release, record))

    def run(self) -> RunResult:
        specs = requests(self.sc.rate, self.sc.requests, self.sc.input_len, self.sc.output_len, self.sc.seed,
                         self.sc.burstiness)
        self.env.process(self._arrivals(specs))
        self.env.run()  # every process ends once every request is done: the queue of events drains
        leaks = [f"{kind}{x.index}: {x.free_blocks} of {x.capacity_blocks} blocks free"
                 for kind, group in (("P", self.p), ("D", self.d)) for x in group
                 if x.capacity_blocks is not None and x.free_blocks != x.capacity_blocks]
        return RunResult(self.sc, self.profile, self.records, self.env.now,
                         sum(d.loop_busy_s for d in self.d), sum(d.steps for d in self.d), leaks,
                         max(p.peak_held_blocks for p in self.p))


def simulate(profile: Profile, scenario: Scenario) -> RunResult:
    return _Run(profile, scenario).run()
