"""`neuron-disagg demo`: one prefill and one decode vLLM instance and the router, on 127.0.0.1.

Builds (once) a tiny random Qwen3 locally, starts P on core 0 and D on core 1 with the
NeuronDisaggConnector (push mode over NIXL), starts the router in front of them, sends a few
requests through the router in push and then in pull mode, and prints each answer with its time to
first token split into segments (``neuron_disagg.timeline``: router, P's queue, prefill, waiting
for D's registration, hand-off to the writer, the write, until D's engine sees it, D's first step),
then the connector's transfer counters from both instances. Each answer is
checked against D computing the same prompt alone. Everything it started is stopped at the end,
also on Ctrl-C.
"""

from __future__ import annotations

import json
import secrets
import tempfile
import time

import httpx
from rich.console import Console

from .. import timeline
from . import tiny_model
from ..local_cluster import disaggregated, free_port, router, start_in_waves, stop_together

PROMPTS = [
    "the quick brown fox jumps over the lazy river",
    "prefill decode cache block tensor trainium neuron fabric write read lease fence " * 6,
    "music garden window morning evening silver copper orange purple yellow green blue red " * 20,
]
CONFIG = {"lease_s": 10, "heartbeat_interval_s": 2, "watchdog_s": 20, "max_write_s": 5}


def _stream(client: httpx.Client, url: str, prompt: str, max_tokens: int, mode: str,
            request_id: str) -> tuple[str, float, float]:
    body = {"model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "disagg_mode": mode}
    start, first, text = time.perf_counter(), None, []
    with client.stream("POST", f"{url}/v1/completions", json=body, headers={"X-Request-Id": request_id}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"])
                first = first or time.perf_counter()
                text.append(chunk["choices"][0]["text"])
    return "".join(text), (first - start) * 1e3, (time.perf_counter() - start) * 1e3


def _breakdown(directory: str, request_id: str) -> str:
    """The request's TTFT segments in ms, from the timeline every process wrote."""
    events = [e for tid, e in timeline.load(directory).items() if tid.startswith(request_id + ".")]
    parts = timeline.breakdown(events[-1]) if events else None
    if parts is None:
        return "(no complete timeline for this request)"
    return " + ".join(f"{name.replace('_', ' ')} {ms * 1e3:.0f}" for name, ms in parts.items() if name != "ttft") + " ms"


def _counters(instance) -> str:
    """The connector's own series on vLLM's /metrics, summed over labels."""
    wanted = ("neuron_disagg_transfers_total", "neuron_disagg_bytes_total", "neuron_disagg_descriptors_total",
              "neuron_disagg_transfers_failed_total")
    totals = dict.fromkeys(wanted, 0.0)
    deadline = time.monotonic() + 15  # vLLM forwards worker stats with a short delay
    while time.monotonic() < deadline:
        for line in httpx.get(f"{instance.url}/metrics", timeout=5).text.splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name in totals:
                totals[name] += float(line.rsplit(" ", 1)[1])
        if totals["neuron_disagg_transfers_total"]:
            break
        totals = dict.fromkeys(wanted, 0.0)
        time.sleep(0.5)
    return ", ".join(f"{k.removeprefix('neuron_disagg_').removesuffix('_total')} {v:,.0f}" for k, v in totals.items())


def readable(text: str, width: int = 72) -> str:
    """A random model's answer as a person can read it on a terminal: control and unprintable
    characters shown as '·', whitespace runs as one space, cut to ``width`` characters."""
    shown = "".join(c if c.isprintable() else "·" for c in " ".join(text.split()))
    return shown if len(shown) <= width else shown[:width - 1] + "…"


def run_demo(console: Console | None = None, max_tokens: int = 24, decode_env: dict | None = None) -> int:
    """0 if every answer equals D computing the prompt alone; ``decode_env`` is added to the decode
    instance's environment (a test injects a fault through it)."""
    console = console or Console()
    secret = secrets.token_hex(32)  # this demo's deployment secret, shared by P and D only
    with console.status("building the tiny model (once)..."):
        model = str(tiny_model.build())
    p_side = free_port()
    marks = tempfile.mkdtemp(prefix="neuron-disagg-demo-timeline-")
    config = {**CONFIG, "timeline_dir": marks}
    p = disaggregated("prefill", model, free_port(), p_side, "0", secret, config)
    d = disaggregated("decode", model, free_port(), free_port(), "1", secret, config, env=decode_env)
    r = router([(p.url, p_side)], [d.url], free_port(), timeline_dir=marks, secret=secret)
    started = []
    ok = True
    try:
        with console.status("starting the prefill and decode vLLM instances (about a minute on 2 cores)..."):
            start_in_waves([p, d], [r], started=started)
        console.print(f"prefill {p.url} (core 0, log {p.log_path})\ndecode  {d.url} (core 1, log {d.log_path})\n"
                      f"router  {r.url}\npush: D registers its blocks while P prefills and P's writer thread writes the "
                      "KV into D over NIXL; pull: D's reader thread reads it from P afterwards\n"
                      "The tiny model's weights are random, so its answers are gibberish: what counts is that the "
                      "disaggregated answer has the same tokens as D computing the prompt alone.\n")
        with httpx.Client(timeout=120) as client:
            for mode in ("push", "pull"):
                console.print(f"[bold]{mode} mode[/]" + (" (P first; D reads P's KV after it finished)" if mode == "pull" else ""))
                for i, prompt in enumerate(PROMPTS, 1):
                    request_id = f"demo-{mode}-{i}"
                    text, ttft, total = _stream(client, r.url, prompt, max_tokens, mode, request_id)
                    # The salt keeps D's prefix cache, which holds the KV just transferred, out of the
                    # reference: D computes every token of the prompt itself.
                    alone = client.post(f"{d.url}/v1/completions", json={
                        "model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": max_tokens,
                        "cache_salt": f"{request_id}-reference-{secrets.token_hex(4)}"}).json()
                    same = alone["choices"][0]["text"] == text
                    ok &= same
                    console.print(f"  request {i} ({len(prompt.split())} words): TTFT {ttft:.0f} ms, total {total:.0f} ms, "
                                  + ("[green]same tokens as D computing alone[/]" if same else "[red]DIFFERS from D alone[/]"))
                    console.print(f"      TTFT = {_breakdown(marks, request_id)}")
                    console.print(f"      answer: {readable(text)}", markup=False, highlight=False)
        console.print(f"\nconnector counters on P: {_counters(p)}\nconnector counters on D: {_counters(d)}")
    except KeyboardInterrupt:
        console.print("interrupted: stopping everything")
        ok = False
    except Exception as exc:  # show where to look, then stop what we started
        console.print(f"[red]demo failed:[/] {exc}")
        for instance in started:
            console.print(f"--- {instance.name} log {instance.log_path} (last lines)\n{instance.tail(15)}")
        ok = False
    finally:
        with console.status("stopping the router and both instances..."):
            stop_together(started)
    console.print("[green]all answers matched[/]" if ok else "[red]demo did not pass[/]")
    return 0 if ok else 1
