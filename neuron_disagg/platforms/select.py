"""Pick the accelerator platform: Neuron devices, else CUDA, else CPU; the config can force one.

The choice and the reason for it are logged once per process, so a log shows why a host moved KV
the way it did. Asking for an accelerator the host lacks fails at startup, naming what was looked for.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib
import logging
import os
import sys

from . import pci
from .base import Platform
from .cpu import CpuPlatform
from .errors import PlatformNotAvailable, UnknownPlatform
from .neuron import NeuronPlatform, neuron_device_nodes

log = logging.getLogger(__name__)
_logged: set[tuple[str, str]] = set()

CHOICES = ("auto", "neuron", "cuda", "cpu")
#: Platforms that live outside this package, loaded by name only once their accelerator was seen:
#: the CUDA one builds on this package, so importing it from here would make the two import each other.
PLUGINS = {"cuda": ("cuda_compat", "CudaPlatform")}


def libcuda_present() -> bool:
    """True when the CUDA driver library loads (a stub is enough for NIXL's LIBFABRIC plugin)."""
    if ctypes.util.find_library("cuda"):
        return True
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def _cuda_probe(root: str) -> tuple[bool, str]:
    """(available, what was seen). torch is imported only if already loaded or a GPU node exists."""
    nodes = glob_nvidia(root)
    torch = sys.modules.get("torch")
    if torch is None and nodes:
        try:
            import torch  # noqa: PLC0415 - lazy on purpose
        except ImportError:
            torch = None
    if torch is not None:
        try:
            if torch.cuda.is_available():
                return True, "torch.cuda.is_available() is True"
        except Exception as exc:  # a broken driver must not crash selection
            log.debug("torch.cuda.is_available() raised %r", exc)
    if nodes:
        if libcuda_present():
            return True, f"{nodes[0]} exists and libcuda loads"
        return False, f"{nodes[0]} exists but libcuda.so.1 does not load"
    return False, "no /dev/nvidia[0-9]* and torch.cuda not available"


def glob_nvidia(root: str) -> list[str]:
    return sorted(glob.glob(pci.under(root, "/dev/nvidia[0-9]*")))


def _cuda_platform(root: str) -> Platform:
    module, name = PLUGINS["cuda"]
    return getattr(importlib.import_module(module), name)(root)


def _log_once(platform: Platform, reason: str) -> None:
    key = (platform.name, reason)
    if key not in _logged:
        _logged.add(key)
        log.info("accelerator platform: %s (%s)", platform.name, reason)


def select_platform(config_platform: str = "auto", root: str = "/") -> tuple[Platform, str]:
    """(platform, reason). ``root`` is the filesystem root to inspect; tests point it at fixtures."""
    if config_platform not in CHOICES:
        raise UnknownPlatform(f"platform {config_platform!r} is not one of {', '.join(CHOICES)}")
    where = "" if root in ("/", "") else f" under {root}"
    if config_platform == "cpu":
        platform, reason = CpuPlatform(root), "platform: cpu set in the config"
    elif config_platform == "neuron":
        if not neuron_device_nodes(root):
            raise PlatformNotAvailable(
                f"the config asks for platform: neuron, but no Neuron device was found: looked for "
                f"/dev/neuron* and /sys/class/neuron_device/*{where}. Run on a trn1/trn2 instance with the "
                "Neuron driver loaded (aws-neuronx-dkms), or set platform: auto")
        platform, reason = NeuronPlatform(root), "platform: neuron set in the config"
    elif config_platform == "cuda":
        ok, seen = _cuda_probe(root)
        if not ok:
            raise PlatformNotAvailable(
                f"the config asks for platform: cuda, but no usable CUDA GPU was found: looked at "
                f"torch.cuda.is_available(), /dev/nvidia[0-9]* and libcuda.so.1{where} ({seen}). Install the "
                "NVIDIA driver and a CUDA build of torch, or set platform: auto")
        platform, reason = _cuda_platform(root), f"platform: cuda set in the config ({seen})"
    else:
        nodes = neuron_device_nodes(root)
        if nodes:
            platform = NeuronPlatform(root)
            reason = f"Neuron devices found ({os.path.basename(nodes[0])} and {len(nodes) - 1} more entries)"
        else:
            ok, seen = _cuda_probe(root)
            if ok:
                platform, reason = _cuda_platform(root), f"no Neuron device; CUDA found: {seen}"
            else:
                platform, reason = CpuPlatform(root), "no Neuron device and no CUDA GPU"
    _log_once(platform, reason)
    return platform, reason
