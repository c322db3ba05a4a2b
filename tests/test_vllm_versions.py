"""The tests that import vLLM (tests/vllm: the plugin, the connector's compatibility layer, vLLM's
own scheduler driving our scheduler side, its metrics, KV layouts from vLLM's own backends) run here
in ./.venv's vLLM; this runs them again in every other vLLM environment set-up builds, and fails
with their output if any fails there. On 0.33 and 0.34 the KV-layout module stays out: it builds
the views with allocation helpers 0.34's extensible KV cache replaced (not adapted yet)."""

from __future__ import annotations

import re

import pytest

from .vllm_envs import EXTENDED, EXTRA, SCHEDULER_LEVEL, extra_env, run_pytest

pytestmark = pytest.mark.integration  # pytest in the other vLLM environments


@pytest.mark.parametrize("version", [*EXTRA, *(pytest.param(v, marks=pytest.mark.extended) for v in EXTENDED)])
def test_tests_that_import_vllm_pass_on(version):
    unadapted = ("--ignore=tests/vllm/test_kv_layouts.py",) if version in SCHEDULER_LEVEL else ()
    done = run_pytest(extra_env(version), "tests/vllm", *unadapted)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, f"on vLLM {version}:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) > 0, summary
    assert "skipped" not in summary, f"on vLLM {version} some tests were skipped: {summary}"
