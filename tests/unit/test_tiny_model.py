"""`python -m neuron_disagg.demo.tiny_model` prints the model's path and nothing else on stdout, also
when it builds it: scripts read the path with $(...)."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="installed with vLLM by scripts/setup.sh")

pytestmark = pytest.mark.integration  # builds the model in a child process


def test_first_build_prints_only_the_path(tmp_path):
    env = {**os.environ, "NEURON_DISAGG_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "neuron_disagg.demo.tiny_model"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith(str(tmp_path)), out.stdout
    assert (tmp_path / lines[0].rsplit("/", 1)[1] / "config.json").exists()
