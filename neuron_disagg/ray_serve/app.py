"""`neuron-disagg ray-serve MODEL --config FILE`: P and D as Ray Serve LLM deployments, our connector
between them, Ray's OpenAI app in front.

The graph is Ray's own P/D graph (ingress -> decode deployment -> prefill deployment, as
``build_pd_openai_app`` builds it) with our decode class (``decode_server``) and our backend
(``backend``), registered under the connector's name in every Ray process. The one config that
``serve`` and ``router`` read configures it; the secret comes from each node's environment (or the
config's ``secret_file``), which Ray's replicas inherit, never from Ray's config. Ray Serve adds
what our router does not: replicas across a cluster, autoscaling (``--deployment-config``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import Any

from ..config import Config, ConfigError
from ..vllm import serve as vllm_serve

CONNECTOR = "NeuronDisaggConnector"
BACKEND = "neuron_disagg.ray_serve.backend:NeuronDisaggBackend"
#: Printed once every application answers: what a supervisor (or test) waits for.
READY_LINE = "ray-serve: serving"
#: Side-channel ports of the second, third ... application (``--modes``) sit this far apart.
APP_PORT_STRIDE = 1000
#: Ray 2.60 (ray/_private/services.py, get_node_ip_address): "0" makes a local node's address
#: 127.0.0.1, and its gRPC servers then bind loopback only (Ray's GrpcServer binds 0.0.0.0 otherwise).
LOOPBACK_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def register() -> None:
    """Ray's registry is cluster-wide: every replica's backend factory finds ours by name."""
    from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import KVConnectorBackendFactory

    if not KVConnectorBackendFactory.is_registered(CONNECTOR):  # one registration, for every application
        KVConnectorBackendFactory.register_backend(CONNECTOR, BACKEND)


def llm_config(role: str, model: str, model_id: str, config: Config, *, replicas: int,
               engine_kwargs: dict[str, Any], env: dict[str, str], deployment_config: dict[str, Any],
               cpu_only: bool) -> dict:
    """One role's Ray ``LLMConfig``: vLLM's engine arguments plus the ``kv_transfer_config`` that
    ``serve`` would give vLLM. On a cluster without GPUs each replica takes one CPU bundle."""
    out = {
        "model_loading_config": {"model_id": model_id, "model_source": model},
        "engine_kwargs": {**engine_kwargs, "kv_transfer_config": vllm_serve.kv_transfer_config(role, config)},
        # Ray refuses a fixed replica count beside autoscaling: the autoscaling config then decides
        "deployment_config": ({} if "autoscaling_config" in deployment_config else {"num_replicas": replicas})
                             | deployment_config,
        "runtime_env": {"env_vars": env},
    }
    if cpu_only:
        out |= {"accelerator_config": {"kind": "cpu"}, "placement_group_config": {"bundles": [{"CPU": 1}]}}
    return out


def _has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


def build_app(model: str, model_id: str, config: Config, *, prefill_replicas: int = 1, decode_replicas: int = 1,
              engine_kwargs: dict[str, Any] | None = None, prefill_env: dict[str, str] | None = None,
              decode_env: dict[str, str] | None = None, deployment_config: dict[str, Any] | None = None):
    """Ray's P/D OpenAI application (``build_pd_openai_app``'s graph) with our decode class."""
    from ray import serve
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
    from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress, make_fastapi_ingress
    from ray.llm._internal.serve.core.server.builder import build_llm_deployment
    from ray.llm._internal.serve.serving_patterns.prefill_decode.builder import PDServingArgs
    from ray.llm._internal.serve.serving_patterns.prefill_decode.pd_server import PDPrefillServer

    from .decode_server import NeuronDisaggDecodeServer

    register()
    common = dict(engine_kwargs=engine_kwargs or {}, deployment_config=deployment_config or {},
                  cpu_only=not _has_gpus())
    args = PDServingArgs.model_validate({
        "prefill_config": llm_config("prefill", model, model_id, config, replicas=prefill_replicas,
                                     env=prefill_env or {}, **common),
        "decode_config": llm_config("decode", model, model_id, config, replicas=decode_replicas,
                                    env=decode_env or {}, **common),
    })
    prefill = build_llm_deployment(args.prefill_config, name_prefix="Prefill:", deployment_cls=PDPrefillServer)
    decode = build_llm_deployment(args.decode_config, name_prefix="Decode:", deployment_cls=NeuronDisaggDecodeServer,
                                  bind_kwargs={"prefill_server": prefill})
    ingress = make_fastapi_ingress(OpenAiIngress)
    options = OpenAiIngress.get_deployment_options([args.decode_config])
    return serve.deployment(ingress, **options).bind(
        llm_deployments={model_id: decode},
        model_cards={model_id: to_model_metadata(model_id, args.decode_config)})


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag} takes KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def _json_object(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{flag} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object, got {type(value).__name__}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="neuron-disagg ray-serve", description=__doc__.splitlines()[0])
    p.add_argument("model", help="model path or Hugging Face id")
    p.add_argument("--config", help="neuron-disagg YAML config (the one `serve` and `router` read)")
    p.add_argument("--model-id", help="the model name clients send (default: MODEL)")
    p.add_argument("--modes", help="comma-separated: one application per mode, at /<mode> "
                   "(default: the config's mode alone, at /)")
    p.add_argument("--prefill-replicas", type=int, default=1)
    p.add_argument("--decode-replicas", type=int, default=1)
    p.add_argument("--engine-kwargs", default="{}", help="vLLM engine arguments for both roles, as a JSON "
                   "object (e.g. '{\"max_model_len\": 2048}')")
    p.add_argument("--deployment-config", default="{}", help="Ray Serve deployment options for both roles, "
                   "as a JSON object (e.g. '{\"autoscaling_config\": {...}}')")
    p.add_argument("--prefill-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the prefill replicas (repeatable); never the secret")
    p.add_argument("--decode-env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--address", help="join this Ray cluster (default: start one on this host)")
    p.add_argument("--num-cpus", type=int, help="CPUs of the Ray cluster started here")
    p.add_argument("--metrics-export-port", type=int, help="where the Ray cluster started here exports "
                   "every replica's metrics, ours (neuron_disagg_*) included, for Prometheus")
    p.add_argument("--host", default="127.0.0.1", help="where Ray Serve's HTTP proxy listens")
    p.add_argument("--port", type=int, default=8000)
    return p


def _exit(*_) -> None:
    raise SystemExit(0)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        base = Config.from_yaml(args.config) if args.config else Config()
        base.load_secret()  # fail now, not in a replica after a minute of start-up
        modes = args.modes.split(",") if args.modes else [base.mode]
        apps = {mode: base.model_copy(update={"mode": mode, "side_channel_port": base.side_channel_port + i * APP_PORT_STRIDE})
                for i, mode in enumerate(modes)}
        if len(set(modes)) != len(modes) or not set(modes) <= {"push", "pull"}:
            raise ConfigError(f"--modes takes push and/or pull, each once; got {args.modes!r}")
        engine_kwargs = _json_object(args.engine_kwargs, "--engine-kwargs")
        deployment_config = _json_object(args.deployment_config, "--deployment-config")
        prefill_env, decode_env = _pairs(args.prefill_env, "--prefill-env"), _pairs(args.decode_env, "--decode-env")
        for env in (prefill_env, decode_env):
            if base.secret_env in env:
                raise ConfigError(f"the secret ({base.secret_env}) comes from each node's environment, not "
                                  "from Ray's config (where the dashboard shows it)")
    except ConfigError as exc:
        print(f"neuron-disagg ray-serve: {exc}", file=sys.stderr)
        return 2

    if not args.address:
        # A cluster of our own, on this host alone: Ray's daemons and workers listen on the node's
        # address, which Ray takes from the default route unless this (read when ray is imported)
        # makes it 127.0.0.1; vLLM's engines in the replicas likewise. The HTTP proxy listens
        # where --host says. NIXL's UCX TCP transport in each engine, which inherits this
        # environment, would listen on every network device but loopback.
        for key, value in {LOOPBACK_NODE_ENV: "0", **vllm_serve.LOOPBACK_FABRIC}.items():
            os.environ.setdefault(key, value)
        for env in (prefill_env, decode_env):  # and the sockets between an engine's processes
            env.setdefault("VLLM_HOST_IP", "127.0.0.1")
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # torch.distributed's, under Ray's node name
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        print(f"neuron-disagg ray-serve: Ray Serve is not installed in this environment ({exc}); install "
              "ray[serve]==2.60.0 beside vLLM 0.29, the vLLM Ray Serve LLM 2.60 pins", file=sys.stderr)
        return 2

    local = {} if args.address else {"num_cpus": args.num_cpus, "_metrics_export_port": args.metrics_export_port}
    # "local": a cluster of our own, never one a previous run left on this host (ray.init joins it)
    ray.init(address=args.address or "local", include_dashboard=False,
             **{k: v for k, v in local.items() if v is not None})
    serve.start(http_options={"host": args.host, "port": args.port})
    signal.signal(signal.SIGTERM, _exit)  # also while serve.run waits for replicas that cannot start
    try:
        serve.run_many([  # every application's replicas start at once
            serve.RunTarget(build_app(args.model, args.model_id or args.model, config,
                                      prefill_replicas=args.prefill_replicas, decode_replicas=args.decode_replicas,
                                      engine_kwargs=engine_kwargs, prefill_env=prefill_env, decode_env=decode_env,
                                      deployment_config=deployment_config),
                            name=f"neuron-disagg-{mode}", route_prefix="/" if len(apps) == 1 else f"/{mode}")
            for mode, config in apps.items()])
        print(f"{READY_LINE} http://{args.host}:{args.port} "
              + ", ".join(f"{m} at /{m if len(apps) > 1 else ''}" for m in apps), flush=True)
        threading.Event().wait()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
