"""A monolithic vLLM server with a prefill and a decode instance beside it, each from one vLLM
environment, and what tests do with them: prompts, both legs of a disaggregated request, the
monolithic reference answer, held KV blocks read off vLLM's /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import tempfile
import time
from pathlib import Path

import httpx

from neuron_disagg import kv_params, timeline
from neuron_disagg.demo import tiny_model
from neuron_disagg.kv_params import ParamsSigner
from neuron_disagg.local_cluster import (BLOCK_SIZE, descendants, disaggregated, free_port, monolithic, router,
                                         stop_together)

from ..vllm_envs import VllmEnv
TIMEOUTS = {"lease_s": 6, "heartbeat_interval_s": 1, "watchdog_s": 20, "max_write_s": 3, "max_read_s": 3,
            "clock_skew_allowance_s": 0.5}
D_BOUND_S = TIMEOUTS["watchdog_s"] + 2 * TIMEOUTS["max_write_s"] + TIMEOUTS["clock_skew_allowance_s"]
# P caps how long a registration may wait for its prefill by its own watchdog_s, and on 2 shared
# cores a queue of prefills of new shapes (vLLM picks CPU kernels per shape) can take longer than the
# short watchdog the liveness tests want on the main D. P and the preemption D get a long one.
PATIENT = {**TIMEOUTS, "watchdog_s": 120}
MAX_MODEL_LEN = 2048
P_STEP_TOKENS = 128
_ids = itertools.count()


def next_id() -> int:
    return next(_ids)
WORDS = ("river mountain ocean forest city music garden window morning evening silver copper orange "
         "purple seven eleven thirty hundred quick lazy brown fox jumps over the lazy dog").split()


class Cluster:
    """``reference_from_decode``: no monolithic server of its own; D computes each reference answer
    alone, under a cache salt that keeps the KV it was sent out of it (as the demo does). One vLLM
    start fewer, for a version that only a few tests run on."""

    def __init__(self, model, env: VllmEnv, reference_from_decode: bool = False, p_stream: str | None = None):
        self.model, self.env = model, env
        self.p_side = free_port()
        self.mono = None if reference_from_decode else monolithic(
            model, free_port(), "0", python=env.python, max_model_len=MAX_MODEL_LEN)
        self.secret = secrets.token_hex(32)
        self.signer = ParamsSigner(self.secret.encode())  # signs kv_transfer_params as the router does
        self.timeline_dir = tempfile.mkdtemp(prefix="neuron-disagg-timeline-")
        # P and D publish their KV events to the router's endpoint (``routed``), as serve makes them.
        self.events = f"127.0.0.1:{free_port()}"
        on = {"timeline_dir": self.timeline_dir, "kv_events_endpoint": self.events}
        # P also takes llm-d's sidecar legs (test_llm_d.py); nothing else sends it unsigned ones.
        # P computes a prompt 128 tokens a step (4 blocks), so that a few hundred words take several
        # steps and push streams their finished blocks while the prefill runs.
        streams = {"stream": p_stream} if p_stream else {}  # unset: the default, by steps
        self.p = self.instance("prefill", self.p_side, "0", {**PATIENT, **on, **streams, "accept_unsigned_prefill_legs": True},
                               extra=("--max-num-batched-tokens", str(P_STEP_TOKENS)))
        # The landing wait at the config's bound, so that an idle D's steps catch every landing they
        # can (at the default 2 ms about half of them here).
        self.d = self.instance("decode", free_port(), "1", {**TIMEOUTS, **on, "landing_wait_s": 0.1})

    def instance(self, role: str, side_port: int, cpu: str, config: dict, **kwargs):
        """A P or D of this cluster's vLLM and model, sharing its secret (not started)."""
        return disaggregated(role, self.model, free_port(), side_port, cpu, self.secret, config,
                             python=self.env.python, max_model_len=MAX_MODEL_LEN, **kwargs)

    def all(self):
        return tuple(i for i in (self.mono, self.p, self.d) if i is not None)

    def listeners(self) -> list[tuple[str, int, str]]:
        return listening(*(i.process.pid for i in self.all()))


def listening(*roots: int) -> list[tuple[str, int, str]]:
    """(address, port, process title) of every TCP socket that ``roots`` or a process below them
    listens on (vLLM's workers and Ray's retitle themselves: VLLM::Worker, ray::ServeReplica:...)."""
    import psutil

    titles = {pid: title(pid) for root in roots for pid in (root, *(p for p, _ in descendants(root)))}
    return [(c.laddr.ip, c.laddr.port, titles[c.pid]) for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid in titles]


def title(pid: int) -> str:
    """A process's title; "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


@contextlib.contextmanager
def running(env: VllmEnv, reference_from_decode: bool = False, p_stream: str | None = None):
    """A started cluster of ``env``'s vLLM with the tiny model, stopped on exit."""
    c = Cluster(str(tiny_model.build()), env, reference_from_decode, p_stream)
    try:
        for instance in c.all():
            instance.start()
        for instance in c.all():
            instance.wait_ready()
        yield c
    finally:
        stop_together(c.all())


@contextlib.contextmanager
def routed(c: Cluster):
    """The router (./.venv's) in front of the cluster's P and D."""
    instance = router([(c.p.url, c.p_side)], [c.d.url], free_port(), timeline_dir=c.timeline_dir,
                      secret=c.secret, extra_args=("--kv-events-endpoint", c.events, "--tokenizer", c.model,
                                                   "--block-size", str(BLOCK_SIZE))).start()
    try:
        yield instance.wait_ready(60)
    finally:
        instance.stop()


def prompt(words: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(words))


def body(text: str, max_tokens: int = 16, **extra) -> dict:
    return {"model": "tiny", "prompt": text, "temperature": 0, "max_tokens": max_tokens, **extra}


def legs(c: Cluster, text: str, max_tokens: int = 16, p_side: int | None = None):
    tid = f"it-{next_id()}-{time.monotonic_ns()}#0"
    p = body(text, 1, kv_transfer_params=kv_params.prefill(c.signer, "push", tid))
    d = body(text, max_tokens, kv_transfer_params=kv_params.push_decode(
        c.signer, tid, f"127.0.0.1:{p_side or c.p_side}", 1))
    return p, d


async def disaggregated_completion(c: Cluster, client: httpx.AsyncClient, text: str, max_tokens: int = 16,
                                  decode=None, prefill=None) -> str:
    """Both legs at once, through ``prefill`` (an (instance, side channel port) pair; the shared P
    by default) and ``decode`` (the shared D by default)."""
    p_instance, p_side = prefill or (c.p, c.p_side)
    p_body, d_body = legs(c, text, max_tokens, p_side)
    p, d = await asyncio.gather(client.post(f"{p_instance.url}/v1/completions", json=p_body),
                                client.post(f"{(decode or c.d).url}/v1/completions", json=d_body))
    assert p.status_code == 200, p.text
    assert d.status_code == 200, d.text
    return d.json()["choices"][0]["text"]


async def registered_first(c: Cluster, client: httpx.AsyncClient, text: str, max_tokens: int = 16) -> str:
    """Both legs, D's first: P's leg is sent once P's writer holds D's registration (its timeline
    says so). For tests of what P does with a registration it has while it prefills: with both
    legs at once, a busy D may register after P's prefill has ended."""
    p_body, d_body = legs(c, text, max_tokens)
    tid = p_body["kv_transfer_params"]["transfer_id"]
    d = asyncio.create_task(client.post(f"{c.d.url}/v1/completions", json=d_body))
    await asyncio.to_thread(wait_for, lambda: "p_registration" in timeline.load(c.timeline_dir).get(tid, {}), 30,
                            "D's registration at P's writer")
    p = await client.post(f"{c.p.url}/v1/completions", json=p_body)
    assert p.status_code == 200, p.text
    d = await d
    assert d.status_code == 200, d.text
    return d.json()["choices"][0]["text"]


async def reference(c: Cluster, client: httpx.AsyncClient, text: str, max_tokens: int = 16) -> str:
    if c.mono is None:
        request = body(text, max_tokens, cache_salt=f"reference-{next_id()}-{time.monotonic_ns()}")
        r = await client.post(f"{c.d.url}/v1/completions", json=request)
    else:
        r = await client.post(f"{c.mono.url}/v1/completions", json=body(text, max_tokens))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def kv_usage(instance) -> float:
    for line in httpx.get(f"{instance.url}/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("vllm:kv_cache_usage_perc not exported")


def wait_for(predicate, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"{what} not reached within {timeout_s} s"
        time.sleep(0.2)
    return time.monotonic() - start


def blocks_back(c: Cluster, timeout_s: float = 20) -> None:
    for instance in (c.p, c.d):
        with explained(c):
            wait_for(lambda: kv_usage(instance) == 0.0, timeout_s, f"{instance.name} KV usage back to 0")


@contextlib.contextmanager
def explained(c: Cluster):
    """A failure inside (an assertion, a client's timeout) says what P and D logged last: CI keeps
    only the tests' output, and a hang's cause is in the servers' logs, not in the client's traceback."""
    try:
        yield
    except (AssertionError, httpx.TimeoutException) as exc:
        logs = "\n".join(f"--- {i.name}: {i.log_path}\n{i.tail(20)}" for i in (c.p, c.d))
        raise AssertionError(f"{type(exc).__name__}: {exc}\n{logs}") from None


def run(coro):
    return asyncio.run(coro)


async def _compare(c, texts, max_tokens=16):
    async with httpx.AsyncClient(timeout=120) as client:
        want = [await reference(c, client, t, max_tokens) for t in texts]
        got = await asyncio.gather(*(disaggregated_completion(c, client, t, max_tokens) for t in texts))
    return want, list(got)


def metric(instance, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{instance.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def handed_over_early(cluster: Cluster, before: float, routed_push: int) -> None:
    """P handed each of ``routed_push`` more push prefills (one token each, as the router sends
    them) to its writer when their forward ended, and neither side counted a bug."""
    wait_for(lambda: metric(cluster.p, "neuron_disagg_early_hand_offs_total") >= before + routed_push, 30,
             f"{routed_push} early hand-offs on P")
    assert metric(cluster.p, "neuron_disagg_connector_bugs_total") == 0
    assert metric(cluster.d, "neuron_disagg_connector_bugs_total") == 0


def nothing_held(cluster: Cluster, timeout_s: float = 15) -> None:
    """The connector's own gauge on each instance's /metrics comes back to no held blocks."""
    for instance in (cluster.p, cluster.d):
        def held():
            lines = [line for line in httpx.get(f"{instance.url}/metrics", timeout=5).text.splitlines()
                     if line.startswith("neuron_disagg_held_blocks{")]
            assert lines, f"{instance.name} exports no neuron_disagg_held_blocks"
            return sum(float(line.rsplit(" ", 1)[1]) for line in lines)
        with explained(cluster):
            wait_for(lambda: held() == 0, timeout_s, f"{instance.name}'s neuron_disagg_held_blocks back to 0")
