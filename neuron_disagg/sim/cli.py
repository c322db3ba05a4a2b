"""`neuron-disagg simulate`: a discrete-event model of push vs pull P/D serving.

Prints the mode x rate x input-length table (TTFT p50/p99, TPOT p50, push/pull ratios), the
published points against the model with % error, the trn2 projection, the push/pull crossover and
a descriptor-count scan. ``--calibrate`` refits the free parameters; ``--sources`` lists where
every parameter came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from .calibrate import CALIBRATION_REQUESTS, calibrate, saturation_note
from .errors import SimulationError
from .profiles import PROFILES, get_profile
from .report import (breakdown_text, crossover_text, reproduction_table, scan_table, scan_verdict, sources_table,
                     sweep_table)
from ..arglists import positive_list
from .steptime import prefill_request_s
from .sweep import SweepOptions, crossover, descriptor_scan, reproduce, sweep, ttft_breakdown


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="neuron-disagg simulate", description=__doc__.splitlines()[0])
    ap.add_argument("--profile", choices=sorted(PROFILES), default="p5en")
    ap.add_argument("--rates", type=positive_list(float, "--rates"), default=[1.0, 2.0, 4.0, 8.0],
                    help="requests/s, comma-separated")
    ap.add_argument("--input-lens", type=positive_list(int, "--input-lens"), default=[1024, 2048, 4096, 8192, 16384],
                    help="prompt tokens")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--requests", type=int, default=400, help="requests per point (first 10%% are warm-up)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    ap.add_argument("--num-p", type=int, default=1, help="prefill instances (xPyD)")
    ap.add_argument("--num-d", type=int, default=1, help="decode instances (xPyD)")
    ap.add_argument("--chunk-tokens", type=int, default=None, help="chunked prefill: tokens per chunk")
    ap.add_argument("--json", metavar="FILE", help="also write every number to FILE")
    ap.add_argument("--calibrate", action="store_true", help="refit the free parameters first and print the fits")
    ap.add_argument("--sources", action="store_true", help="print every parameter's value and source, then exit")
    ap.add_argument("--no-extras", action="store_true",
                    help="only the sweep table: skip published points, trn2 projection and descriptor scan")
    return ap


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except SimulationError as e:
        print(f"neuron-disagg simulate: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    profile = get_profile(args.profile)
    if args.sources:
        print(sources_table(profile))
        if args.profile == "p5en":
            print(sources_table(get_profile("trn2")))
        return 0
    out: dict = {"profile": args.profile}
    if args.calibrate:
        profile, fits = calibrate(profile, args.requests, args.seed)
        print("calibration:")
        for f in fits:
            print(f"  {f.parameter} = {f.value:.6g}  ({f.target}; model gives {f.achieved:.2f})")
        out["fits"] = [f.__dict__ for f in fits]
    opts = SweepOptions(args.output_len, args.requests, args.seed, args.burstiness, args.num_p, args.num_d,
                        args.chunk_tokens)
    g = profile.geometry
    print(f"{profile.description}\n{args.num_p}P{args.num_d}D, output {args.output_len} tokens, "
          f"{args.requests} requests per point (first 10% warm-up), seed {args.seed}, burstiness {args.burstiness:g}; "
          f"KV {g.kv_bytes_per_token() * 16384 / 2**30:.1f} GiB per 16k request\n")
    rows = sweep(profile, args.rates, args.input_lens, opts)
    print(sweep_table(rows, args.rates, args.input_lens))
    cross = crossover(rows, args.rates, args.input_lens)
    print("\npush/pull crossover (equal within 5%):\n" + crossover_text(cross, args.rates))
    out["sweep"] = [s.as_dict() for s in rows]
    out["crossover"] = {m: {str(k): v for k, v in c.items()} for m, c in cross.items()}
    extras = not args.no_extras and args.output_len == 128 and (args.num_p, args.num_d) == (1, 1)
    if extras and args.profile == "p5en":
        # The published points are checked with the request count the fits were made with.
        check = dataclasses.replace(opts, requests=args.requests if args.calibrate else CALIBRATION_REQUESTS, seed=0)
        published = reproduce(profile, check)
        print(f"\npublished (vLLM PR 35264, p5en, Qwen3-32B TP8) vs simulated — mean of the medians of seeds 0-2, "
              f"{check.requests} requests each:")
        print(reproduction_table(published))
        print("note: " + saturation_note(profile))
        scan = descriptor_scan(profile, check)
        print("\npull's mechanism vs descriptor count at 8 QPS x 16k (fragmentation varied, all else fixed; "
              "mean of 3 seeds' medians):")
        print(scan_table(scan))
        print(scan_verdict(scan))
        breakdown = ttft_breakdown(profile, check)
        print("\nwhere TTFT goes at 8 QPS x 16k, and what could add pull's missing second (mean of 3 seeds):")
        print(breakdown_text(breakdown, published, prefill_request_s(profile, 16384)))
        out["ttft_breakdown"] = [b.__dict__ for b in breakdown]
        out["published"] = [dict(r.__dict__, error=r.error) for r in published]
        out["descriptor_scan"] = [{"descriptors": n, "push": a.as_dict(), "pull": b.as_dict()} for n, a, b in scan]
    if extras and args.profile == "p5en":
        trn2 = get_profile("trn2")
        lens = sorted({min(args.input_lens), max(args.input_lens)})
        projected = sweep(trn2, args.rates, lens, opts)
        print("\ntrn2 projection (INFERRED layout and efficiencies; see --sources):")
        print(sweep_table(projected, args.rates, lens))
        print(crossover_text(crossover(projected, args.rates, lens), args.rates))
        out["trn2"] = [s.as_dict() for s in projected]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    print(f"\n({time.perf_counter() - started:.1f} s)")
    return 0
