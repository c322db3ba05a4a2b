"""The benchmark's start-up patch for its reference instances (``bench/keep_affinity``): applied
there through PYTHONPATH, waiting for vLLM's CPU platform to be imported, and nowhere else."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from neuron_disagg.bench import keep_affinity
from neuron_disagg.bench.topology import ServerSettings, _build

PACKAGE = Path(keep_affinity.__file__).resolve().parents[2]  # neuron_disagg/


def site_module():
    """The sitecustomize's parts, read under another name: it installs nothing then."""
    path = Path(keep_affinity.SITE_DIR) / "sitecustomize.py"
    spec = importlib.util.spec_from_file_location("keep_affinity_site", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_patch_waits_for_its_module_and_applies_once_it_is_executed(tmp_path, monkeypatch):
    site = site_module()
    (tmp_path / "fake_platforms").mkdir()
    (tmp_path / "fake_platforms" / "__init__.py").write_text("")
    (tmp_path / "fake_platforms" / "cpu.py").write_text(
        "class CpuPlatform:\n    @classmethod\n    def discover_numa_topology(cls):\n        return [[0, 1]]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    finder = site.PatchOnImport("fake_platforms.cpu", site.keep_affinity)
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    try:
        import fake_platforms  # noqa: F401  the package alone: nothing to patch yet
        assert "fake_platforms.cpu" not in sys.modules
        from fake_platforms.cpu import CpuPlatform

        assert CpuPlatform.discover_numa_topology() == []
        # the module's own loader still answers what else is asked of it
        assert "return [[0, 1]]" in sys.modules["fake_platforms.cpu"].__loader__.get_source("fake_platforms.cpu")
    finally:
        for name in ("fake_platforms", "fake_platforms.cpu"):
            sys.modules.pop(name, None)


def test_server_env_puts_the_patch_first_and_keeps_the_path_it_had():
    assert keep_affinity.server_env({"PYTHONPATH": "/a:/b"}) == {"PYTHONPATH": f"{keep_affinity.SITE_DIR}:/a:/b"}
    assert keep_affinity.server_env({}) == {"PYTHONPATH": keep_affinity.SITE_DIR}
    assert sorted(p.name for p in Path(keep_affinity.SITE_DIR).glob("*.py")) == ["__init__.py", "sitecustomize.py"]


def test_the_bench_starts_vllms_reference_instances_with_it_and_ours_without(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.mkdtemp", lambda prefix="": str(tmp_path))  # the timeline's directory
    server = ServerSettings("tiny")
    p, d, router = _build(("vllm-pull",), server).instances
    assert [i.env["PYTHONPATH"].split(os.pathsep)[0] for i in (p, d)] == [keep_affinity.SITE_DIR] * 2
    assert not any("PYTHONPATH" in i.env for i in [router, *_build(("push", "pull"), server).instances])


def test_the_product_never_patches_vllms_cpu_platform():
    product = [p for p in PACKAGE.rglob("*.py") if "bench" not in p.relative_to(PACKAGE).parts]
    assert product and not [str(p) for p in product if "discover_numa_topology" in p.read_text()]


@pytest.mark.integration  # a fresh interpreter that imports vLLM
def test_a_process_started_with_it_finds_no_cores_to_reserve_for_vllms_nixl_worker():
    pytest.importorskip("vllm", reason="vLLM's CPU build is installed by scripts/setup.sh")
    # which function answers, too: where sysfs shows no NUMA nodes vLLM's own finds none either
    probe = ("import json; from vllm.platforms.cpu import CpuPlatform; "
             "discover = CpuPlatform.discover_numa_topology; "
             "print(json.dumps([discover(), discover.__func__.__module__]))")
    env = {**os.environ, **keep_affinity.server_env()}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [[], "sitecustomize"]
