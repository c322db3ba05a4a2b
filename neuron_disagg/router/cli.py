"""``neuron-disagg router``: parse flags, validate everything, serve until SIGINT/SIGTERM.

Called by ``neuron_disagg.cli.main`` with the arguments after ``router``. A bad flag, spec or
config file exits with status 2 and a message naming what to fix, before anything listens.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from ..config import Config, ConfigError
from ..kv_params import ROLES, ParamsSigner
from ..protocol.wire import WireCodec
from .instances import Instance, InstanceSpecError, parse_instance_spec
from .health import RoleMismatch
from .server import start_router
from .settings import MODES, RouterSettings

API_KEY_ENV = "NEURON_DISAGG_ROUTER_API_KEY"
_TUNABLES = ("connect_timeout_s", "prefill_timeout_s", "decode_first_byte_timeout_s",
             "decode_idle_timeout_s", "health_interval_s", "health_timeout_s",
             "health_failures_to_eject", "metrics_stale_s", "decode_silent_s", "kv_cache_full_fraction",
             "prefill_retries", "max_body_bytes", "upstream_connection_limit", "upstream_keepalive_s",
             "affinity_epsilon", "affinity_window_s", "block_size", "kv_events_stale_s", "prefix_history_ttl_s")


def _horizon(value: str) -> int | str:
    """``--bind-horizon-ms``: "arrival" or milliseconds (validated with the other settings)."""
    if value == "arrival":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'arrival' or whole milliseconds, got {value!r}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="neuron-disagg router",
        description="Push-aware OpenAI-compatible router in front of vLLM prefill and decode instances.")
    parser.add_argument("--prefill", action="append", default=[], metavar="SPEC",
                        help="a prefill instance, repeatable: URL[,side_channel=HOST:PORT][,tp=N]"
                             "[,engine_id=ID]; side_channel defaults to the URL's host and the config's "
                             "side_channel_port; engine_id only for a P running vLLM's NixlPushConnector")
    parser.add_argument("--decode", action="append", default=[], metavar="URL",
                        help="a decode instance, repeatable")
    parser.add_argument("--mode", choices=MODES,
                        help="KV transfer mode (default: the config's mode); a request may override "
                             "it with a top-level \"disagg_mode\" field. vllm-push and vllm-pull "
                             "drive instances running vLLM's own NixlPushConnector / NixlConnector")
    parser.add_argument("--config", metavar="FILE", help="the deployment config shared with the instances")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", help=f"clients must send it as a Bearer token (prefer the "
                                          f"{API_KEY_ENV} environment variable: flags show in ps)")
    parser.add_argument("--timeline-dir", metavar="DIR",
                        help=RouterSettings.model_fields["timeline_dir"].description)
    parser.add_argument("--bind-horizon-ms", type=_horizon, metavar="arrival|MS",
                        help=f"{RouterSettings.model_fields['bind_horizon_ms'].description} (default: arrival)")
    parser.add_argument("--tokenizer", metavar="PATH|NAME", help=RouterSettings.model_fields["tokenizer"].description)
    parser.add_argument("--kv-events-endpoint", metavar="HOST:PORT",
                        help="where to listen for the instances' KV events (default: the config's kv_events_endpoint)")
    parser.add_argument("--no-prefix-routing", action="store_true",
                        help="route by load alone, not by what instances hold")
    parser.add_argument("--no-decode-fallback", action="store_true",
                        help="fail a request no P can take (502/503) instead of having a D compute it whole")
    parser.add_argument("--log-level", default="INFO",
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    defaults = RouterSettings()
    for name in _TUNABLES:
        field = RouterSettings.model_fields[name]
        kind = int if isinstance(getattr(defaults, name), int) else float
        parser.add_argument("--" + name.replace("_", "-"), type=kind, metavar="N",
                            help=f"{field.description or name} (default {getattr(defaults, name)})")
    return parser


def build(argv: list[str]) -> tuple[RouterSettings, list[Instance], Config, ParamsSigner | None, argparse.Namespace]:
    """Everything ``main`` needs, validated; raises ConfigError or InstanceSpecError."""
    args = _parser().parse_args(argv)
    config = Config.from_yaml(args.config) if args.config else Config()
    if args.kv_events_endpoint:  # checked as the config checks its own
        config = Config.from_mapping({**config.model_dump(exclude_unset=True), "kv_events_endpoint": args.kv_events_endpoint},
                                     source="--kv-events-endpoint")
    settings = RouterSettings.build(
        tokenizer=args.tokenizer, kv_events_endpoint=config.kv_events_endpoint,
        prefix_routing=False if args.no_prefix_routing else None,
        mode=args.mode or config.mode,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        timeline_dir=args.timeline_dir, decode_fallback=False if args.no_decode_fallback else None,
        bind_horizon_ms=None if args.bind_horizon_ms in (None, "arrival") else args.bind_horizon_ms,
        **{name: getattr(args, name) for name in _TUNABLES})
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {args.port}")
    instances = [parse_instance_spec("prefill", s, config.side_channel_port) for s in args.prefill]
    instances += [parse_instance_spec("decode", s, config.side_channel_port) for s in args.decode]
    urls = [i.url for i in instances]
    dupes = sorted({u for u in urls if urls.count(u) > 1})
    if dupes:
        raise InstanceSpecError(f"instance(s) given more than once: {', '.join(dupes)}")
    if settings.mode == "vllm-push":
        missing = [i.url for i in instances if i.role == "prefill" and not i.engine_id]
        if missing:
            raise InstanceSpecError(f"--mode vllm-push needs engine_id=ID on every --prefill (the engine_id "
                                    f"in that P's --kv-transfer-config); missing on {', '.join(missing)}")
    return settings, instances, config, _signer(config, settings.mode), args


def _signer(config: Config, mode: str) -> ParamsSigner | None:
    """Our connector acts only on kv_transfer_params signed with the deployment secret: modes push
    and pull need it (a missing secret fails here, at startup); a router for vLLM's own connectors
    signs when it can, for requests that ask for our modes."""
    try:
        return config.params_signer()
    except ConfigError as exc:
        if mode.startswith("vllm-"):
            return None
        raise ConfigError(f"mode {mode} signs kv_transfer_params with the deployment secret: {exc}") from None


async def _serve(settings: RouterSettings, instances: list[Instance], config: Config,
                 signer: ParamsSigner | None, host: str, port: int) -> None:
    log = logging.getLogger("neuron_disagg.router")
    codec = WireCodec(config.load_secret(), config.max_message_bytes) if signer is not None else None
    router = await start_router(settings, instances, host=host, port=port,
                                side_channel_port=config.side_channel_port, signer=signer, codec=codec)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    roles = {r: [i.url for i in instances if i.role == r] for r in ROLES}
    log.info("router on %s, mode %s, prefill %s, decode %s%s", router.url, settings.mode,
             roles["prefill"] or "none", roles["decode"] or "none",
             ", API key required" if settings.api_key else "")
    if not roles["prefill"] or not roles["decode"]:
        log.warning("no %s instance yet: requests get 503 until one is added with POST /admin/instances",
                    "prefill" if not roles["prefill"] else "decode")
    try:
        await stop.wait()
    finally:
        log.info("shutting down: open streams get up to 10 s")
        await router.close()


def main(argv: list[str]) -> int:
    try:
        settings, instances, config, signer, args = build(argv)
    except (ConfigError, InstanceSpecError) as exc:
        print(f"neuron-disagg router: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(_serve(settings, instances, config, signer, args.host, args.port))
    except OSError as exc:  # e.g. a port is taken
        where = "" if str(exc).startswith("for KV events") else f"on {args.host}:{args.port}: "
        print(f"neuron-disagg router: cannot listen {where}{exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # the tokenizer did not load
        print(f"neuron-disagg router: not started: {exc}", file=sys.stderr)
        return 2
    except RoleMismatch as exc:
        print(f"neuron-disagg router: not started: {exc}", file=sys.stderr)
        return 1
    return 0
