"""CUDA selection and KV fencing against a stubbed torch.cuda; real-GPU checks marked `cuda`."""

from __future__ import annotations

import pytest

from neuron_disagg.platforms import select_platform
from neuron_disagg.platforms.fence import CallbackFence, ReadyFence

from .conftest import FakeEvent


def test_cuda_selected_when_torch_sees_a_gpu(host, fake_torch):
    root, _ = host("none")
    platform, reason = select_platform("auto", root=root)
    assert platform.name == "cuda" and "torch.cuda.is_available()" in reason
    assert type(platform).__module__ == "cuda_compat.platform"
    assert platform.memory_type == "VRAM" and platform.nixl_backend() == "UCX"


def test_neuron_beats_cuda(host, fake_torch):
    root, _ = host("trn2")
    assert select_platform("auto", root=root)[0].name == "neuron"


def test_explicit_cuda_with_stub(host, fake_torch):
    root, _ = host("none")
    assert select_platform("cuda", root=root)[0].name == "cuda"


def test_wait_for_kv_records_an_event_the_writer_waits_on(host, fake_torch):
    root, _ = host("none")
    platform, _ = select_platform("cuda", root=root)
    platform.use_kv_device("cuda:3")
    fence = platform.wait_for_kv()
    (event,) = FakeEvent.instances
    assert event.recorded_on == "current stream of cuda:3", "on the KV device's stream, not the default one"
    assert not fence.ready() and event.synchronized == 0
    fence.wait()  # what the writer thread does before posting the WRITE
    assert event.synchronized == 1 and fence.ready()
    platform.wait_for_kv(stream="s1")
    assert FakeEvent.instances[-1].recorded_on == "s1"


def test_host_staging_is_off_on_cuda_unless_asked_for(host, fake_torch):
    """A failed VRAM registration on a GPU is a fault to see at start-up, not one to hide behind
    host copies; only Neuron, where some runtimes cannot register device memory, stages by default."""
    root, _ = host("none")
    cuda, _ = select_platform("cuda", root=root)
    cpu, _ = select_platform("cpu", root=root)
    assert cuda.host_staging(None) == "never" and cpu.host_staging(None) == "never"
    assert cuda.host_staging("auto") == "auto" and cuda.host_staging("always") == "always"


def test_gpu_affinity_from_pci(tmp_path, fake_torch):
    from . import fake_sysfs
    from cuda_compat import CudaPlatform
    desc = fake_sysfs.load("trn2")
    gpus = [dict(n, name=f"gpu{i}", vendor="0x10de", device="0x2335") for i, n in enumerate(desc["neuron"][:8])]
    fake_sysfs.build(tmp_path, {"neuron": [], "efa": desc["efa"], "dev_nodes": [], "gpus": gpus})
    platform = CudaPlatform(str(tmp_path))
    assert len(platform.accelerators()) == 8
    first = platform.accelerators()[0].name
    assert platform.efa_affinity()[first] == desc["expected_affinity"]["neuron0"]


def test_neuron_fence_follows_the_route_the_kv_lives_on(host, monkeypatch):
    """The vLLM Neuron plugin's default route keeps KV on the native ``neuron`` device; the XLA
    route on ``xla``; its CPU mode on ``cpu``. Each gets the fence of its own runtime."""
    import sys
    import types
    root, _ = host("trn2")
    platform, _ = select_platform("auto", root=root)
    assert platform.host_staging(None) == "auto"  # some Neuron runtimes cannot register device memory

    platform.use_kv_device(types.SimpleNamespace(type="cpu"))
    assert isinstance(platform.wait_for_kv(), ReadyFence)

    calls = []
    xm = types.SimpleNamespace(mark_step=lambda: calls.append("mark_step"),
                               wait_device_ops=lambda: calls.append("wait_device_ops"))
    core = types.SimpleNamespace(xla_model=xm)
    monkeypatch.setitem(sys.modules, "torch_xla", types.SimpleNamespace(core=core))
    monkeypatch.setitem(sys.modules, "torch_xla.core", core)
    monkeypatch.setitem(sys.modules, "torch_xla.core.xla_model", xm)
    platform.use_kv_device(types.SimpleNamespace(type="xla"))
    calls.clear()
    fence = platform.wait_for_kv()
    assert isinstance(fence, CallbackFence) and calls == ["mark_step"] and not fence.ready()
    fence.wait()
    fence.wait()
    assert calls == ["mark_step", "wait_device_ops"] and fence.ready()


def test_unknown_kv_device_on_a_neuron_host_is_refused(host):
    import types
    from neuron_disagg.platforms import PlatformError
    root, _ = host("trn2")
    platform, _ = select_platform("auto", root=root)
    with pytest.raises(PlatformError, match="neuron device"):
        platform.use_kv_device(types.SimpleNamespace(type="cuda"))


@pytest.mark.cuda
def test_real_cuda_event_fence():
    import torch
    platform, _ = select_platform("cuda")
    x = torch.ones(1 << 20, device="cuda")
    y = x * 2
    fence = platform.wait_for_kv()
    fence.wait()
    assert fence.ready() and float(y.sum()) == 2 * (1 << 20)
