"""Run by every Python process that finds this directory first on its PYTHONPATH: the processes of
a reference instance the benchmark starts (``__init__.py`` says why). Once vLLM's CPU platform is
imported, its NUMA discovery finds no cores to reserve for transfers.

Standard library only, and nothing imported ahead of time: a process that never imports vLLM's CPU
platform (most of what such a server starts) pays one list entry.
"""

from __future__ import annotations

import sys

TARGET = "vllm.platforms.cpu"


def no_reserved_cores(cls) -> list[list[int]]:
    return []


def keep_affinity(module) -> None:
    module.CpuPlatform.discover_numa_topology = classmethod(no_reserved_cores)


class _ThenPatch:
    """A module's own loader, then ``patch`` on the module it executed; anything else the import
    system or ``inspect`` asks of a loader goes to the module's own."""

    def __init__(self, loader, patch):
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class PatchOnImport:
    """A meta path finder that finds ``name`` as the finders after it would, and patches the module
    once it is executed: the patch waits for the module without importing it early."""

    def __init__(self, name: str, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _ThenPatch(spec.loader, self.patch)
                return spec
        return None


if __name__ == "sitecustomize":  # loaded at start-up, not by a test reading its parts
    sys.meta_path.insert(0, PatchOnImport(TARGET, keep_affinity))
