"""`neuron-disagg serve --dry-run`: the vLLM command it would exec, from the one config file."""

from __future__ import annotations

import importlib.util
import json
import shlex
from pathlib import Path

import pytest

from neuron_disagg.vllm import serve

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="serve needs vLLM, installed by scripts/setup.sh")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "qwen3-32b.yaml"


def transfer_config(capsys) -> dict:
    words = shlex.split(capsys.readouterr().out.strip().splitlines()[-1])
    return json.loads(words[words.index("--kv-transfer-config") + 1])


def test_each_pod_passes_its_own_side_channel_address_over_the_shared_deployment_file(monkeypatch, capsys):
    monkeypatch.setenv("NEURON_DISAGG_SECRET", "s" * 32)
    assert serve.main(["prefill", "m", "--config", str(EXAMPLE), "--side-channel-host", "10.1.2.3", "--dry-run"]) == 0
    extra = transfer_config(capsys)["kv_connector_extra_config"]
    assert extra["side_channel_host"] == "10.1.2.3" and extra["mode"] == "push"  # the file's section, and ours

