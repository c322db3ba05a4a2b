"""Typed errors of the accelerator layer; each message says what was looked for and how to fix it."""

from __future__ import annotations


class PlatformError(RuntimeError):
    """Base of every accelerator-layer error, so callers can catch this layer's failures at once."""


class PlatformNotAvailable(PlatformError):
    """The config asked for an accelerator that this host does not have."""


class UnknownPlatform(PlatformError):
    """The config named a platform this package does not implement."""
