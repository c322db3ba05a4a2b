"""Arrival times and request shapes, the way `vllm bench serve` draws them: Poisson at a rate, or
gamma inter-arrivals with a burstiness (shape) factor, mean 1/rate either way. Why a separate module:
the M/D/1 test and the sweeps must draw exactly the same arrivals for a seed, in any mode."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ScenarioError


@dataclass(frozen=True)
class RequestSpec:
    rid: int
    arrival_s: float
    input_len: int
    output_len: int


def arrivals(rate: float, count: int, seed: int, burstiness: float = 1.0) -> np.ndarray:
    """``count`` arrival times from 0. Burstiness 1 is Poisson; below 1 burstier, above 1 smoother."""
    if not rate > 0:
        raise ScenarioError(f"arrival rate must be > 0 requests/s, got {rate}")
    if not burstiness > 0:
        raise ScenarioError(f"burstiness must be > 0 (1 = Poisson), got {burstiness}")
    if count < 1:
        raise ScenarioError(f"need at least one request, got {count}")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def requests(rate: float, count: int, input_len: int, output_len: int, seed: int,
             burstiness: float = 1.0) -> list[RequestSpec]:
    if input_len < 1 or output_len < 1:
        raise ScenarioError(f"input and output lengths must be >= 1 token, got {input_len} and {output_len}")
    times = arrivals(rate, count, seed, burstiness)
    return [RequestSpec(i, float(t), input_len, output_len) for i, t in enumerate(times)]
