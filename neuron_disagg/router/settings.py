"""The router's own knobs, validated once at startup.

``cli.py`` builds a ``RouterSettings`` from flags (defaults below); tests build one directly. The
deployment ``Config`` (``--config``, shared with the instances) supplies the default mode and the
side-channel port; router knobs are not put in that file because ``Config`` forbids unknown keys
and every instance reads the same file.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..config import ConfigError

# "vllm-push" and "vllm-pull" drive vLLM's own NixlPushConnector and NixlConnector (P and D run
# those instead of ours): the same router and load, so the benchmark compares connectors only.
Mode = Literal["push", "pull", "vllm-push", "vllm-pull"]
MODES: tuple[Mode, ...] = ("push", "pull", "vllm-push", "vllm-pull")
PUSH_MODES: frozenset[str] = frozenset({"push", "vllm-push"})


class RouterSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Mode = Field("push", description="how KV moves, unless a request says `disagg_mode`")
    api_key: str | None = Field(None, min_length=1, repr=False,
                                description="clients must send `Authorization: Bearer <key>`")
    connect_timeout_s: float = Field(5.0, gt=0, le=600, description="TCP connect to an instance")
    prefill_timeout_s: float = Field(300.0, gt=0, le=86400,
                                     description="whole P leg: send, prefill, answer")
    decode_first_byte_timeout_s: float = Field(
        600.0, gt=0, le=86400,
        description="D leg sent -> first body byte (streaming) or whole answer (non-streaming)")
    decode_idle_timeout_s: float = Field(300.0, gt=0, le=86400,
                                         description="longest gap between two chunks of D's stream")
    health_interval_s: float = Field(1.0, gt=0, le=3600, description="GET /health on every instance")
    health_timeout_s: float = Field(5.0, gt=0, le=600, description="one health check")
    # A vLLM busy with prefill can answer /health late; only a refused connection (a dead process)
    # ejects at once. Ejecting the only P or D on one slow answer fails every request meanwhile.
    health_failures_to_eject: int = Field(3, ge=1, le=100,
                                          description="consecutive slow or failed checks before ejection")
    metrics_stale_s: float = Field(30.0, gt=0, le=3600,
                                   description="ignore a D's scraped /metrics older than this")
    decode_silent_s: float = Field(1.0, gt=0, le=600, description="a D that has not answered a health check, "
                                   "or whose streams have sent nothing, for this long is picked last")
    kv_cache_full_fraction: float = Field(0.95, gt=0, le=1.0,
                                          description="a D above this KV usage is picked last")
    prefill_retries: int = Field(1, ge=0, le=5, description="P legs retried on another P")
    decode_fallback: bool = Field(True, description="a request no P can take (none healthy, or P's leg failed "
                                  "with no retry left: unreachable, disconnected, 5xx) is sent whole to a D, "
                                  "which computes its prompt too, instead of failing with 502/503")
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024, le=1024 * 1024 * 1024)
    upstream_connection_limit: int = Field(0, ge=0, description="0: unlimited")
    # vLLM's API server closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s by default).
    upstream_keepalive_s: float = Field(4.0, gt=0, le=3600, description="idle upstream connections are "
                                        "closed after this; keep it below the instances' keep-alive timeout")
    bind_horizon_ms: int | None = Field(
        None, ge=0, le=600_000, description="push: send D's leg (and choose D) when P's predicted remaining "
        "prefill time falls to this; None ('arrival'): both legs at arrival; 0: when P answers")
    prefix_routing: bool = Field(True, description="route by what each instance holds (its KV events, or this "
                                 "router's history) as well as by load, where the prompt's token ids are known")
    affinity_epsilon: float = Field(0.25, ge=0, le=10, description="what an instance holds may draw a leg to it "
                                    "only while that keeps it within (1 + this) x the mean load")
    tokenizer: str | None = Field(None, min_length=1, description="the model's tokenizer (a path or hub name), "
                                  "to match text prompts against what instances hold; without it only prompts "
                                  "sent as token ids are matched")
    kv_events_endpoint: str | None = Field(None, min_length=3, description="HOST:PORT where this router listens "
                                           "for the instances' KV events (the config's kv_events_endpoint)")
    affinity_window_s: float = Field(30.0, gt=0, le=3600, description="an instance's load, for that bound, counts "
                                     "the legs sent to it this long back as well as those it runs now")
    block_size: int = Field(16, ge=1, le=4096, description="the instances' KV block size (vLLM's --block-size), "
                            "which their KV events must carry")
    kv_events_stale_s: float = Field(10.0, gt=0, le=3600, description="an instance whose legs keep ending this "
                                     "long after its last KV event has stopped publishing: its history is used")
    prefix_history_ttl_s: float = Field(300.0, gt=0, le=86400, description="without KV events, a prompt sent to "
                                        "an instance is counted as held there this long")
    timeline_dir: str | None = Field(None, min_length=1, description="append each transfer's arrival "
                                     "and first-byte times here (see neuron_disagg.timeline)")

    @classmethod
    def build(cls, **values: object) -> RouterSettings:
        """Validates ``values``; raises ConfigError naming each bad field and what it accepts."""
        try:
            return cls.model_validate({k: v for k, v in values.items() if v is not None})
        except ValidationError as exc:
            lines = [f"  {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
            raise ConfigError("invalid router settings:\n" + "\n".join(lines)) from None
