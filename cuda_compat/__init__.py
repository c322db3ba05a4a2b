"""The CUDA (NVIDIA H200, p5en) platform: same interface as ``neuron_disagg.platforms``.

A top-level package so Neuron and CPU installs never import anything CUDA-related; the selector
imports it only after it has seen a CUDA device.
"""

from .platform import CudaPlatform, cuda_device_nodes, libcuda_present

__all__ = ["CudaPlatform", "cuda_device_nodes", "libcuda_present"]
