"""Cost parameters, each carrying its unit and where its value came from.

Why every number is a ``Sourced``: the simulator is only as credible as its inputs, and a reader
comparing its output with a measurement needs to know which inputs were measured here, which were
published, which were fitted and which were guessed. ``Profile.sources()`` prints that list.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .errors import ProfileError

# Where a value came from, in one word; the free text after it says exactly where.
KINDS = ("measured", "published", "calibrated", "inferred", "assumed", "derived")


@dataclass(frozen=True)
class Sourced:
    value: float
    unit: str
    source: str

    def __post_init__(self) -> None:
        kind = self.source.split(":", 1)[0]
        if kind not in KINDS:
            raise ProfileError(f"source {self.source!r} must start with one of {', '.join(KINDS)} and a colon")
        if not math.isfinite(self.value) or self.value < 0:
            raise ProfileError(f"{self.value!r} {self.unit} is not a finite non-negative value ({self.source})")


@dataclass(frozen=True)
class Geometry:
    """The model and its sharding: what fixes KV bytes, descriptor counts and FLOPs per token."""

    name: str
    layers: int
    kv_heads: int
    q_heads: int
    head_dim: int
    dtype_bytes: int
    block_tokens: int
    tp: int
    linear_params: float  # non-embedding weights that every token multiplies through
    weight_bytes: float

    def kv_bytes_per_token(self) -> int:
        """All ranks together: K and V, every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def kv_heads_per_rank(self) -> int:
        """With more ranks than KV heads, heads are replicated (one per rank); each is sent once."""
        return max(1, self.kv_heads // self.tp)

    def kv_bytes_per_token_per_rank(self) -> int:
        return 2 * self.layers * self.kv_heads_per_rank() * self.head_dim * self.dtype_bytes

    def regions_per_rank(self) -> int:
        """One block-major region per layer and K/V (vLLM's split K/V layout)."""
        return 2 * self.layers

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def descriptors(self, tokens: int, run_blocks: float) -> int:
        """One descriptor per contiguous run of blocks per region: ``run_blocks`` is the mean run."""
        runs = max(1, math.ceil(self.blocks(tokens) / max(1.0, run_blocks)))
        return self.regions_per_rank() * runs


@dataclass(frozen=True)
class Profile:
    """Everything the discrete-event model needs for one deployment (hardware + model + stack)."""

    name: str
    description: str
    geometry: Geometry
    # hardware, per tensor-parallel rank
    peak_flops: Sourced
    hbm_bytes_per_s: Sourced
    nic_bytes_per_s: Sourced
    # efficiencies and step costs
    prefill_mfu: Sourced
    prefill_step_base_s: Sourced
    hbm_efficiency: Sourced
    decode_step_base_s: Sourced
    decode_per_seq_s: Sourced
    # transfer costs
    post_s_per_desc: Sourced
    pull_prep_s_per_desc: Sourced
    push_plan_s_per_desc: Sourced
    run_blocks: Sourced
    handoff_s: Sourced
    d_admit_s: Sourced
    wire_latency_s: Sourced
    notify_s: Sourced
    side_channel_s: Sourced
    router_hop_s: Sourced
    frontend_s_per_token: Sourced
    # capacities (KV blocks per instance); 0 means unlimited
    p_blocks: Sourced = field(default_factory=lambda: Sourced(0, "blocks", "assumed: unlimited"))
    d_blocks: Sourced = field(default_factory=lambda: Sourced(0, "blocks", "assumed: unlimited"))
    # steps by which an engine's scheduler sees a transfer's completion later than the boundary that
    # follows it (vLLM's async scheduling: one); 0 means the next boundary, as a synchronous loop
    sched_lag_steps: Sourced = field(default_factory=lambda: Sourced(0, "steps", "assumed: synchronous loop"))

    def v(self, name: str) -> float:
        return getattr(self, name).value

    def replace(self, **values: Sourced | float) -> Profile:
        """A copy with some parameters changed; a bare float keeps the unit and says 'assumed: override'."""
        changes = {}
        for key, new in values.items():
            old = getattr(self, key, None)
            if not isinstance(old, Sourced):
                raise ProfileError(f"{key!r} is not a cost parameter of profile {self.name!r}; "
                                   f"choose from {', '.join(self.parameter_names())}")
            changes[key] = new if isinstance(new, Sourced) else Sourced(float(new), old.unit, "assumed: override")
        return dataclasses.replace(self, **changes)

    def parameter_names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), Sourced)]

    def sources(self) -> list[tuple[str, Sourced]]:
        return [(name, getattr(self, name)) for name in self.parameter_names()]
