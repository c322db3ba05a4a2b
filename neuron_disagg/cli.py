"""The one `neuron-disagg` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["router"]:  # the router parses its own flags
        from .router.cli import main as router_main
        return router_main(argv[1:])
    if argv[:1] == ["bench"]:
        from .bench.cli import main as bench_main
        return bench_main(argv[1:])
    if argv[:1] == ["simulate"]:
        from .sim.cli import main as simulate_main
        return simulate_main(argv[1:])
    if argv[:1] and argv[0] in ("launch", "status", "teardown", "instance-profile"):
        from .deploy.cli import main as deploy_main
        return deploy_main(argv)
    if argv[:1] == ["doctor"]:
        from .doctor import main as doctor_main
        return doctor_main(argv[1:])
    if argv[:1] == ["install-fabric-libs"]:
        from .platforms.fabric_libs import main as fabric_libs_main
        return fabric_libs_main(argv[1:])
    if argv[:1] == ["serve"]:  # passes everything after `--` to `vllm serve`
        from .vllm.serve import main as serve_main
        return serve_main(argv[1:])
    if argv[:1] == ["ray-serve"]:
        from .ray_serve.app import main as ray_serve_main
        return ray_serve_main(argv[1:])
    parser = argparse.ArgumentParser(prog="neuron-disagg", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="P, D and the router on 127.0.0.1 with a tiny model: push mode end to end")
    demo.add_argument("--in-process", action="store_true",
                      help="instead: the protocol core alone in one process over an in-memory transport, "
                           "with each request's timeline")
    demo.add_argument("--prefill-ms", type=float, default=20.0, help="--in-process: simulated prefill time")
    sub.add_parser("router", help="push-aware OpenAI-compatible proxy (see `neuron-disagg router --help`)")
    sub.add_parser("bench", help="monolithic vs ours (push, pull) vs vLLM's NIXL connectors under load, "
                                 "side by side (see `neuron-disagg bench --help`)")
    sub.add_parser("simulate", help="discrete-event model of push vs pull serving (see `neuron-disagg simulate --help`)")
    for name in ("launch", "status", "teardown", "instance-profile"):
        sub.add_parser(name, help=f"AWS deployment: {name} (see `neuron-disagg {name} --help`)")
    sub.add_parser("doctor", help="check this host for serving: vLLM, NIXL backends, EFA, Neuron, config (see --help)")
    sub.add_parser("install-fabric-libs", help="put what NIXL's LIBFABRIC plugin needs besides libfabric in place "
                                               "(Neuron: libcuda stub, CUDA runtime, hwloc; --platform cuda: CUDA "
                                               "runtime, hwloc) (see --help)")
    sub.add_parser("serve", help="start vLLM as a prefill or decode instance (see `neuron-disagg serve --help`)")
    sub.add_parser("ray-serve", help="P and D as Ray Serve LLM deployments behind Ray's OpenAI app, our connector "
                                     "between them (needs ray[serve]; see `neuron-disagg ray-serve --help`)")
    args = parser.parse_args(argv)
    if args.command == "demo" and args.in_process:
        from .demo.in_process import run_demo
        return run_demo(prefill_ms=args.prefill_ms)
    if args.command == "demo":
        from .demo.served import run_demo
        return run_demo()
    return 2


if __name__ == "__main__":
    sys.exit(main())
