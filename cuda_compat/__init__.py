"""The CUDA (NVIDIA H200, p5en) platform: same interface as ``neuron_disagg.platforms``.

A top-level package so Neuron and CPU installs never import anything CUDA-related. Imports point
one way: this package builds on ``neuron_disagg.platforms``, which never imports it; the selector
loads ``CudaPlatform`` by name (``platforms.select.PLUGINS``) only after it has seen a CUDA device.
"""

from .platform import CudaPlatform

__all__ = ["CudaPlatform"]
