"""`neuron-disagg serve prefill|decode MODEL [--config FILE] [-- vllm serve args...]`.

Starts `vllm serve` with the --kv-transfer-config derived from our config, so users never write
that JSON. Refuses a vLLM older than the supported range (``compat.RANGE``; below 0.14.0 naming
CVE-2026-22807: code execution through dynamic module loading).
On a Neuron host moving KV over LIBFABRIC it puts what NIXL's LIBFABRIC plugin needs there (a
libcuda stub, the CUDA runtime library, hwloc: ``neuron-disagg install-fabric-libs``) on vLLM's
LD_LIBRARY_PATH, and refuses to start where the backend cannot load.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import uuid

from ..config import Config, ConfigError
from . import compat, failures

ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}

#: The environment of a vLLM server whose peers are all on its host (a one-host cluster: the demo,
#: the tests, the benchmark, a local Ray Serve): NIXL's UCX TCP transport would otherwise listen on
#: every network device but loopback (measured: the host's address, in every vLLM worker), where on
#: one host UCX moves the KV over cma/shm anyway. A value in the environment wins (a user who wants
#: the fabric's devices sets it).
LOOPBACK_FABRIC = {"UCX_NET_DEVICES": "lo"}


def kv_transfer_config(role: str, config: Config, engine_id: str | None = None) -> dict:
    # What differs from the defaults, and what the config names even at its default (a side channel
    # host written as 127.0.0.1 is meant, where a Ray replica would otherwise advertise its node's).
    extra = {**config.model_dump(mode="json", exclude_defaults=True), **config.model_dump(mode="json", exclude_unset=True)}
    return {
        "kv_connector": "NeuronDisaggConnector",
        "kv_connector_module_path": "neuron_disagg.vllm.connector",
        "kv_role": ROLES[role],
        "kv_load_failure_policy": config.kv_load_failure_policy,
        "kv_buffer_device": "cpu",
        "engine_id": engine_id or f"{role}-{uuid.uuid4().hex[:12]}",
        "kv_connector_extra_config": extra,
    }


def library_env(config: Config, env: dict[str, str], root: str = "/") -> dict[str, str]:
    """``env`` for vLLM: on a Neuron host moving KV over LIBFABRIC, with the directory of what NIXL's
    LIBFABRIC plugin needs there (``neuron-disagg install-fabric-libs``) first on LD_LIBRARY_PATH."""
    from ..platforms import fabric_libs
    from ..platforms.errors import PlatformNotAvailable
    from ..platforms.select import select_platform

    try:
        platform, _ = select_platform(config.platform, root)
    except PlatformNotAvailable as exc:
        raise ConfigError(str(exc)) from None
    if platform.name != "neuron" or platform.nixl_backend(config.backend) != "LIBFABRIC":
        return env
    directory = fabric_libs.find()
    if directory is None:
        state = fabric_libs.loads(None)
        if state == "loaded":
            return env
        raise ConfigError(f"NIXL's LIBFABRIC backend does not load on this Neuron host ({state}); it needs "
                          "libcuda.so.1, libcudart and libhwloc even here: run `sudo neuron-disagg "
                          "install-fabric-libs` once (our AMI has)")
    return {**env, "LD_LIBRARY_PATH": fabric_libs.library_path(directory, env)}


def _flag(args: list[str], name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` in vLLM's arguments (the last one given)."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def own_url(config: Config, vllm_args: list[str]) -> str:
    """The URL the router reaches this instance at: vLLM's --host (the side channel's host where vLLM
    listens on every address) and --port (vLLM's default 8000)."""
    host = _flag(vllm_args, "--host")
    if host in (None, "", "0.0.0.0", "::"):
        host = config.side_channel_host
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{_flag(vllm_args, '--port') or 8000}"


def kv_events_config(config: Config, vllm_args: list[str]) -> dict | None:
    """vLLM's KV events, published to the router (config.kv_events_endpoint) under this instance's
    URL: the publisher connects there and listens nowhere."""
    if config.kv_events_endpoint is None:
        return None
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://{config.kv_events_endpoint}",
            "topic": own_url(config, vllm_args)}


def build_command(role: str, model: str, config: Config, vllm_args: list[str], python: str = sys.executable) -> list[str]:
    # Only a failing policy produces reasons to tell: under recompute no request fails for want of
    # KV, and the middleware would only add a hop to every streamed chunk.
    told = ["--middleware", failures.MIDDLEWARE] if config.kv_load_failure_policy == "fail" else []
    events = kv_events_config(config, vllm_args)
    if events is not None and _flag(vllm_args, "--kv-events-config") is None:  # the user's own wins
        told += ["--kv-events-config", json.dumps(events)]
    return [python, "-m", "vllm.entrypoints.cli.main", "serve", model,
            "--kv-transfer-config", json.dumps(kv_transfer_config(role, config)), *told, *vllm_args]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="neuron-disagg serve", description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=sorted(ROLES))
    parser.add_argument("model")
    parser.add_argument("--config", help="neuron-disagg YAML config (side channel, leases, secret source)")
    parser.add_argument("--side-channel-host", help="this instance's address for the side channel, over the "
                        "config's (one config for every pod: Kubernetes passes each its own, $(POD_IP))")
    parser.add_argument("--dry-run", action="store_true", help="print the vllm command and exit")
    ours, _, theirs = (argv[: argv.index("--")], "--", argv[argv.index("--") + 1:]) if "--" in argv else (argv, "", [])
    args = parser.parse_args(ours)
    try:
        config = Config.from_yaml(args.config) if args.config else Config()
        if args.side_channel_host:
            config = Config.from_mapping({**config.model_dump(exclude_unset=True), "side_channel_host": args.side_channel_host},
                                         source="--side-channel-host")
        config.load_secret()  # fail now, not in a worker process after a minute of start-up
        version = compat.installed_version()
        if compat.check_version(version):
            print(f"neuron-disagg serve: vLLM {version} is newer than the tested range ({compat.RANGE}); "
                  "the connector checks its API at start-up", file=sys.stderr)
        env = library_env(config, dict(os.environ))
    except (ConfigError, compat.UnsupportedVLLM) as exc:
        print(f"neuron-disagg serve: {exc}", file=sys.stderr)
        return 2
    command = build_command(args.role, args.model, config, theirs)
    if args.dry_run:
        added = env.get("LD_LIBRARY_PATH") != os.environ.get("LD_LIBRARY_PATH")
        print((f"LD_LIBRARY_PATH={env['LD_LIBRARY_PATH']} " if added else "") + shlex.join(command))  # pastes into a shell
        return 0
    os.execve(command[0], command, env)
    return 0  # not reached
