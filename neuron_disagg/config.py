"""The one validated configuration object.

Read from a YAML file (``--config``) or from vLLM's ``kv_connector_extra_config``. Every knob has a
default and a unit in its name; an invalid value fails at startup with the field and the allowed
range. The deployment secret is read from the environment or a file, never from the config itself,
and never printed.
"""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .protocol.consumer import ConsumerTimeouts
from .protocol.lender import LenderTimeouts
from .protocol.producer import ProducerTimeouts
from .protocol.reader import ReaderTimeouts
from .protocol.timeouts import DEFAULTS, Timeouts
from .protocol.wire import MIN_SECRET_BYTES

if TYPE_CHECKING:
    from .kv_params import ParamsSigner


#: In a deployment file (``deploy.settings``, examples/qwen3-32b.yaml) the connector's config is this
#: section: every command that reads a config reads that file too, so one file carries a deployment.
DEPLOYMENT_SECTION = "neuron_disagg"


class ConfigError(ValueError):
    """The configuration is invalid; the message names each bad field and what it accepts."""


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["push", "pull"] = Field("push", description="how KV moves from P to D")
    lease_s: float = Field(DEFAULTS.lease_s, gt=0, le=3600,
                           description="P holds finished blocks this long without word from D")
    heartbeat_interval_s: float = Field(DEFAULTS.heartbeat_interval_s, gt=0, le=600,
                                        description="D renews P's lease this often")
    watchdog_s: float = Field(DEFAULTS.watchdog_s, gt=0, le=3600,
                              description="D waits this long for KV after registering")
    admission_timeout_s: float = Field(DEFAULTS.admission_timeout_s, gt=0, le=86400,
                                       description="D waits this long to allocate blocks")
    max_write_s: float = Field(DEFAULTS.max_write_s, gt=0, le=3600,
                               description="P gives up on a write that takes longer, then waits as long "
                               "again for it to end before releasing it; D fences its blocks for both")
    max_read_s: float = Field(DEFAULTS.max_read_s, gt=0, le=3600,
                              description="pull: D gives up on a read that takes longer (P's lease on an "
                              "offer covers it), then keeps its blocks as long again for it to end")
    clock_skew_allowance_s: float = Field(DEFAULTS.clock_skew_allowance_s, ge=0, le=60,
                                          description="added to fences: clock skew + tick interval")
    tombstone_s: float = Field(DEFAULTS.tombstone_s, gt=0, le=86400,
                               description="ended transfers are remembered this long")
    suspect_after_s: float = Field(DEFAULTS.suspect_after_s, ge=0.3, le=600,
                                   description="D: a P rank that answers no probe for this long (or refuses "
                                   "one, or answers as a restarted process) is gone: the requests waiting "
                                   "on it go on at once (computed here, or failed, as the policy says); "
                                   "their blocks stay fenced until P's writes can no longer land. Probes go "
                                   "a third of this apart")
    secret_env: str = Field("NEURON_DISAGG_SECRET", min_length=1,
                            description="environment variable holding the deployment secret")
    secret_file: Path | None = Field(None, description="file holding the secret (used if set)")
    params_ttl_s: float = Field(DEFAULTS.params_ttl_s, gt=0, le=86400,
                                description="the router's signed kv_transfer_params are honoured this "
                                "long; a request queued longer runs as a plain request")
    accept_unsigned_prefill_legs: bool = Field(
        False, description="P: a leg marked only with vLLM's do_remote_decode (what llm-d's routing sidecar "
        "sends) is computed under pull, and P answers with D's whole params, signed here, so the sidecar "
        "needs no secret. Off: such a leg runs as a plain request. On, whoever reaches P's port can make "
        "it hold a prompt's KV for lease_s")
    side_channel_host: str = Field("127.0.0.1", min_length=1)
    side_channel_port: int = Field(5600, ge=1024, le=65535)
    backend: Literal["auto", "UCX", "LIBFABRIC"] = "auto"
    platform: Literal["auto", "neuron", "cuda", "cpu"] = "auto"
    max_message_bytes: int = Field(4 * 1024 * 1024, ge=4096, le=64 * 1024 * 1024)
    stream: Literal["off", "chunks", "layers"] | None = Field(
        None, description="push: write P's KV into D's registered blocks while the prefill runs. chunks "
        "(the default): each step's finished blocks once that step ends, so only the last step's KV is "
        "left to write when the prefill is done; layers: within each step too, each group of layers once "
        "its KV is written (where vLLM calls save_kv_layer after each layer: CUDA and CPU, not Neuron), so "
        "a prompt of one step streams as well, at the cost of the writer's work inside the forward; off: "
        "the whole prompt at the end (to compare)")
    stream_layer_groups: int = Field(
        8, ge=1, le=256, description="stream: layers posts each step's write in at most this many "
        "groups of consecutive layers: one fence and one post per group and D rank, however many layers")
    host_staging: Literal["auto", "always", "never"] | None = Field(
        None, description="move KV through host memory: auto = only if NIXL cannot register the "
        "device's memory, always, or never (fail at start-up). Unset: auto on Neuron (some runtimes "
        "cannot register device memory), never elsewhere (a failed GPU registration is a fault to "
        "see, not one to hide behind slow host copies); push mode only")
    host_staging_blocks: int | None = Field(
        None, ge=1, description="host slots per rank when staging (default: a quarter of the KV blocks)")
    kv_load_failure_policy: Literal["recompute", "fail"] = Field(
        "recompute", description="when KV cannot arrive (P dead or hung, a write failed, the watchdog "
        "fired), D computes the prompt itself (recompute) or the request fails (fail); `serve` sets "
        "vLLM's kv_load_failure_policy from it")
    landing_wait_s: float = Field(
        0.002, ge=0, le=0.1, description="D: in an engine step that computes nothing while KV is landing, "
        "wait up to this long for it, so that this step reports it rather than the next one (vLLM's loop "
        "sleeps between such steps anyway); a request or abort arriving meanwhile waits at most this "
        "long. 0: never wait")
    timeline_dir: Path | None = Field(None, description="append per-transfer timestamps here (for the "
                                      "TTFT breakdown of the demo and the benchmark); off when unset")
    kv_events_endpoint: str | None = Field(
        None, description="HOST:PORT where the router listens for the instances' KV cache events: `serve` "
        "makes each instance publish there (it connects; it listens on no port of its own), and the router "
        "routes by what each holds. Unset: no events; the router goes by what it sent where")

    @field_validator("kv_events_endpoint")
    @classmethod
    def _events_endpoint_is_an_address(cls, value: str | None) -> str | None:
        if value is None:
            return None
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError("must be HOST:PORT with a port in 1..65535, e.g. 10.0.0.4:5570")
        # vLLM's publisher binds (listens on every instance) when its endpoint holds '*' or '::'.
        if host in ("*", "0.0.0.0") or "::" in host:
            raise ValueError("must name the router's own address (instances connect to it), not a wildcard "
                             "or an IPv6 address written with '::'")
        return value

    @model_validator(mode="after")
    def _heartbeats_fit_in_lease(self) -> Config:
        if self.heartbeat_interval_s * 2 > self.lease_s:
            raise ValueError(
                f"heartbeat_interval_s ({self.heartbeat_interval_s}) must be at most half of "
                f"lease_s ({self.lease_s}) so that one lost heartbeat does not expire a lease"
            )
        return self

    # -- construction -------------------------------------------------------------------------------
    @classmethod
    def from_mapping(cls, values: dict[str, Any] | None, source: str = "config") -> Config:
        try:
            return cls.model_validate(values or {})
        except ValidationError as exc:
            lines = []
            for err in exc.errors():
                field = ".".join(str(p) for p in err["loc"]) or "(config)"
                given = f" (got {err['input']!r})" if err["loc"] and err["type"] != "missing" else ""
                lines.append(f"  {field}: {err['msg']}{given}")
            raise ConfigError(f"invalid {source}:\n" + "\n".join(lines)) from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> Config:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of settings")
        if isinstance(data.get(DEPLOYMENT_SECTION), dict):  # a deployment file: its connector section
            return cls.from_mapping(data[DEPLOYMENT_SECTION], source=f"config file {path}, {DEPLOYMENT_SECTION}")
        return cls.from_mapping(data, source=f"config file {path}")

    # -- derived ------------------------------------------------------------------------------------
    def load_secret(self) -> bytes:
        """The deployment secret, from ``secret_file`` if set, else the ``secret_env`` variable."""
        if self.secret_file is not None:
            try:
                secret = self.secret_file.read_bytes().strip()
            except OSError as exc:
                raise ConfigError(f"cannot read secret_file {self.secret_file}: {exc.strerror}") from None
            where = f"secret_file {self.secret_file}"
        else:
            secret = os.environ.get(self.secret_env, "").encode()
            where = f"environment variable {self.secret_env}"
        if len(secret) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"{where} must hold a secret of at least {MIN_SECRET_BYTES} bytes, the same on every "
                "prefill and decode instance; create one with `openssl rand -hex 32`"
            )
        return secret

    def params_signer(self) -> ParamsSigner:
        """Signs (router) and verifies (connector) kv_transfer_params under the deployment secret."""
        from .kv_params import ParamsSigner

        return ParamsSigner(self.load_secret(), self.params_ttl_s, self.clock_skew_allowance_s)

    @property
    def side_channel(self) -> str:
        return f"{self.side_channel_host}:{self.side_channel_port}"

    def timeouts(self) -> Timeouts:
        """The configured timeouts, which each side's are picked from by name."""
        return Timeouts(**{f.name: getattr(self, f.name) for f in fields(Timeouts)})

    def producer_timeouts(self) -> ProducerTimeouts:
        return self.timeouts().for_side(ProducerTimeouts)

    def lender_timeouts(self) -> LenderTimeouts:
        return self.timeouts().for_side(LenderTimeouts)

    def reader_timeouts(self) -> ReaderTimeouts:
        return self.timeouts().for_side(ReaderTimeouts)

    def consumer_timeouts(self) -> ConsumerTimeouts:
        return self.timeouts().for_side(ConsumerTimeouts)
