"""The one `neuron-disagg` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["router"]:  # the router parses its own flags
        from .router.cli import main as router_main
        return router_main(argv[1:])
    if argv[:1] == ["serve"]:  # passes everything after `--` to `vllm serve`
        from .vllm.serve import main as serve_main
        return serve_main(argv[1:])
    parser = argparse.ArgumentParser(prog="neuron-disagg", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the push protocol end to end and print each request's timeline")
    demo.add_argument("--in-process", action="store_true", default=True,
                      help="one process, in-memory transport (the only demo until the vLLM connector lands)")
    demo.add_argument("--prefill-ms", type=float, default=20.0, help="simulated prefill time per request")
    sub.add_parser("router", help="push-aware OpenAI-compatible proxy (see `neuron-disagg router --help`)")
    sub.add_parser("serve", help="start vLLM as a prefill or decode instance (see `neuron-disagg serve --help`)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo_core import run_demo
        return run_demo(prefill_ms=args.prefill_ms)
    return 2


if __name__ == "__main__":
    sys.exit(main())
