"""Fixtures for the accelerator layer: fake host trees, a stubbed torch.cuda, GPU-only skipping."""

from __future__ import annotations

import sys
import types

import pytest

from . import fake_sysfs


def _has_cuda() -> bool:
    import glob
    if not glob.glob("/dev/nvidia[0-9]*"):
        return False  # no GPU node: skip without paying for a torch import
    try:
        import torch
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if any(item.get_closest_marker("cuda") for item in items) and not _has_cuda():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if item.get_closest_marker("cuda"):
                item.add_marker(skip)


@pytest.fixture
def host(tmp_path):
    """host("trn2") -> (root, description): a fake filesystem root built from a fixture."""
    def make(name: str):
        root = tmp_path / name
        return str(root), fake_sysfs.build(root, name)
    return make


class FakeEvent:
    instances: list[FakeEvent] = []

    def __init__(self, *args, **kwargs):
        self.recorded_on = "unrecorded"
        self.done = False
        self.synchronized = 0
        FakeEvent.instances.append(self)

    def record(self, stream=None):
        self.recorded_on = stream or "current"

    def query(self):
        return self.done

    def synchronize(self):
        self.synchronized += 1
        self.done = True


@pytest.fixture
def fake_torch(monkeypatch):
    """A stub ``torch`` whose ``cuda`` says a GPU is there and hands out FakeEvents."""
    FakeEvent.instances = []
    cuda = types.SimpleNamespace(is_available=lambda: True, Event=FakeEvent,
                                 current_stream=lambda device=None: f"current stream of {device}")
    torch = types.ModuleType("torch")
    torch.cuda = cuda
    monkeypatch.setitem(sys.modules, "torch", torch)
    return torch
