"""The tests that import vLLM (tests/vllm: the plugin, the connector's compatibility layer, its
metrics, KV layouts from vLLM's own backends) run here in ./.venv's vLLM; this runs them again in
every other vLLM environment set-up builds, and fails with their output if any fails there."""

from __future__ import annotations

import re

import pytest

from .vllm_envs import EXTRA, extra_env, run_pytest

pytestmark = pytest.mark.integration  # pytest in the other vLLM environments


@pytest.mark.parametrize("version", EXTRA)
def test_tests_that_import_vllm_pass_on(version):
    done = run_pytest(extra_env(version), "tests/vllm")
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, f"on vLLM {version}:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) > 0, summary
    assert "skipped" not in summary, f"on vLLM {version} some tests were skipped: {summary}"
