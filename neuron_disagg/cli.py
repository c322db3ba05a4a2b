"""The one `neuron-disagg` command."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Callable
from typing import NamedTuple


class Command(NamedTuple):
    module: str  # relative to this package; its ``main(argv)`` parses the command's own flags
    extra: str | None  # the optional dependencies it needs beyond the base install
    help: str


# A vLLM environment installs the base package (connector, serve, doctor); the rest come with extras.
COMMANDS: dict[str, Command] = {
    "serve": Command(".vllm.serve", None,
                     "start vLLM as a prefill or decode instance (see `neuron-disagg serve --help`)"),
    "doctor": Command(".doctor", None,
                      "check this host for serving: vLLM, NIXL backends, EFA, Neuron, config (see --help)"),
    "install-fabric-libs": Command(".platforms.fabric_libs", None,
                                   "put what NIXL's LIBFABRIC plugin needs besides libfabric in place (Neuron: "
                                   "libcuda stub, CUDA runtime, hwloc; --platform cuda: CUDA runtime, hwloc)"),
    "router": Command(".router.cli", "router",
                      "push-aware OpenAI-compatible proxy (see `neuron-disagg router --help`)"),
    "bench": Command(".bench.cli", "bench", "monolithic vs ours (push, pull) vs vLLM's NIXL connectors under "
                                            "load, side by side (see `neuron-disagg bench --help`)"),
    "ray-serve": Command(".ray_serve.app", "ray", "P and D as Ray Serve LLM deployments behind Ray's OpenAI app, "
                                                  "our connector between them (see `neuron-disagg ray-serve --help`)"),
    **{name: Command(".deploy.cli", "deploy", f"AWS deployment: {name} (see `neuron-disagg {name} --help`)")
       for name in ("launch", "status", "teardown", "instance-profile")},
}
# The top-level modules each extra brings (pyproject.toml), checked before a command starts, so a
# bench without matplotlib fails at once rather than after its runs.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "router": ("aiohttp", "prometheus_client", "zmq"),
    "demo": ("aiohttp", "prometheus_client", "zmq", "httpx", "rich"),
    "bench": ("aiohttp", "prometheus_client", "zmq", "httpx", "rich", "matplotlib", "pandas"),
    "deploy": ("boto3", "botocore"),
    "ray": ("ray",),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    name = argv[0] if argv else None
    if name in COMMANDS:
        command = COMMANDS[name]
        # The deploy commands share one parser, which reads the command's name itself.
        args = argv if command.module == ".deploy.cli" else argv[1:]
        return _with_extra(name, command.extra, lambda: importlib.import_module(command.module, __package__).main(args))
    parser = argparse.ArgumentParser(prog="neuron-disagg", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="P, D and the router on 127.0.0.1 with a tiny model: push mode end to end")
    demo.add_argument("--in-process", action="store_true",
                      help="instead: the protocol core alone in one process over an in-memory transport, "
                           "with each request's timeline")
    demo.add_argument("--prefill-ms", type=float, default=20.0, help="--in-process: simulated prefill time")
    for command_name, command in COMMANDS.items():
        sub.add_parser(command_name, help=command.help)
    args = parser.parse_args(argv)
    if args.in_process:
        return _with_extra("demo", "demo", lambda: _demo_in_process(args.prefill_ms))
    return _with_extra("demo", "demo", _demo_served)


def _demo_in_process(prefill_ms: float) -> int:
    from .demo.in_process import run_demo
    return run_demo(prefill_ms=prefill_ms)


def _demo_served() -> int:
    from .demo.served import run_demo
    return run_demo()


def _with_extra(name: str, extra: str | None, run: Callable[[], int]) -> int:
    """Runs a command once the modules of its extra are importable; otherwise says which extra to install."""
    missing = [m for m in EXTRA_MODULES.get(extra or "", ()) if importlib.util.find_spec(m) is None]
    if missing:
        print(f"neuron-disagg {name} needs the [{extra}] extra ({', '.join(missing)} not installed): "
              f"pip install 'neuron-disagg[{extra}]'", file=sys.stderr)
        return 2
    return run()


if __name__ == "__main__":
    sys.exit(main())
