"""Accelerator layer: what differs between Neuron, CUDA and CPU hosts."""

from .base import Platform
from .errors import PlatformError, PlatformNotAvailable, UnknownPlatform
from .select import select_platform

__all__ = ["Platform", "PlatformError", "PlatformNotAvailable", "UnknownPlatform", "select_platform"]
