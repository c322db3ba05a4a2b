"""Typed errors for the simulator: each message says which input was wrong and what to pass instead,
so a bad sweep fails at argument parsing, not minutes into a run."""

from __future__ import annotations


class SimulationError(Exception):
    """Base class: anything the simulator refuses to do."""


class ScenarioError(SimulationError, ValueError):
    """A scenario (mode, rate, lengths, counts, capacities) that cannot be simulated as given."""


class ProfileError(SimulationError, ValueError):
    """An unknown profile name or a cost parameter outside its meaningful range."""


class CapacityError(SimulationError):
    """A request can never fit: it needs more KV blocks than the instance's whole pool."""
