"""Interleaved rounds (``neuron-disagg bench --rounds N``): every topology is started once and
kept up, all but the one being measured paused (SIGSTOP of each instance's whole process group,
so a paused one takes no CPU, not even vLLM's idle spinners), and the modes are measured in rounds
A B C, A B C, ... A machine whose speed drifts then slows every mode alike, where one topology after
another puts the drift between modes. Each point's figures are the median over the rounds; the
TTFT p50 of every round is kept beside it, for the spread.

What it costs: memory for every topology at once (five modes: seven vLLM instances, about 12 GiB
with the tiny model here), and nothing in time: the starts are the same, the points the same."""

from __future__ import annotations

import statistics
from contextlib import ExitStack
from dataclasses import fields, replace
from collections.abc import Callable

from .load import RunResult
from .topology import Running, ServerSettings, started

# measure(group, topology, round index) -> that group's results, one per mode and load
Measure = Callable[[tuple[str, ...], Running, int], list[RunResult]]
StartFailed = Callable[[tuple[str, ...], Exception], list[RunResult]]


def pause(topology: Running) -> None:
    for instance in topology.instances:
        instance.pause()


def resume(topology: Running) -> None:
    for instance in topology.instances:
        instance.resume()


def measure_in_rounds(groups: list[tuple[str, ...]], server: ServerSettings, rounds: int, measure: Measure,
                      start_failed: StartFailed, idle_window_s: float = 0,
                      on_start: Callable[[tuple[str, ...], Running], None] = lambda g, t: None) -> list[RunResult]:
    """Starts every group's topology (each one paused before the next starts, so idle CPU is read
    with nothing else running), then measures the groups in turn, ``rounds`` times. Returns one
    result per mode and load, the median over the rounds, and ``start_failed``'s for the groups
    that did not start."""
    per_round: list[list[RunResult]] = []
    failed: list[RunResult] = []
    with ExitStack() as stack:
        up: list[tuple[tuple[str, ...], Running]] = []
        try:
            for group in groups:
                try:
                    topology = stack.enter_context(started(group, server, idle_window_s=idle_window_s))
                except (RuntimeError, TimeoutError) as exc:  # one topology failing to start: the rest still run
                    failed += start_failed(group, exc)
                    continue
                on_start(group, topology)
                pause(topology)
                up.append((group, topology))
            for n in range(rounds):
                this_round: list[RunResult] = []
                for group, topology in up:
                    resume(topology)
                    try:
                        this_round += measure(group, topology, n)
                    finally:
                        pause(topology)
                per_round.append(this_round)
        finally:
            for _, topology in up:  # stopped processes would not hear the SIGTERM that stops them
                resume(topology)
    return median_over_rounds(per_round) + failed


def median_over_rounds(per_round: list[list[RunResult]]) -> list[RunResult]:
    """One result per (mode, rate, input length), in the first round's order: each figure the
    median of the rounds that measured it, request counts summed, errors kept, and every round's
    TTFT p50 in ``rounds_ttft_p50_ms``."""
    if not per_round:
        return []
    out = []
    figures = [f.name for f in fields(RunResult) if f.name not in ("mode", "rate", "input_len", "output_len")]
    for first in per_round[0]:
        point = (first.mode, first.rate, first.input_len)
        runs = [r for results in per_round for r in results if (r.mode, r.rate, r.input_len) == point]
        merged = {}
        for name in figures:
            values = [getattr(r, name) for r in runs if getattr(r, name) is not None]
            if name in ("prompts", "completed", "failed"):
                merged[name] = sum(values)
            elif name == "error":
                merged[name] = "; ".join(dict.fromkeys(values)) or None
            elif name == "rounds_ttft_p50_ms":
                merged[name] = [r.ttft_p50_ms for r in runs]
            elif values and isinstance(values[0], dict):
                keys = dict.fromkeys(k for v in values for k in v)
                merged[name] = {k: statistics.median(v[k] for v in values if k in v) for k in keys}
            else:
                merged[name] = statistics.median(values) if values else None
        out.append(replace(first, **merged))
    return out
