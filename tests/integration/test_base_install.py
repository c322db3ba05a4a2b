"""The base install in a clean environment: `pip install neuron-disagg` (as uv installs it, from this
checkout) brings the connector's own dependencies and nothing from the extras, runs `doctor` and
`serve`'s checks, and a command that needs an extra says which one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
# What the base dependencies (pyproject.toml) bring with them, and nothing else.
BASE = {"neuron-disagg", "msgspec", "pydantic", "pydantic-core", "annotated-types", "typing-extensions",
        "typing-inspection", "pyyaml", "numpy"}


@pytest.fixture(scope="module")
def base_env(tmp_path_factory):
    env_dir = tmp_path_factory.mktemp("base") / "env"
    install = f'source scripts/uv.sh && "$UV" venv -q --python {sys.executable} {env_dir} && ' \
              f'uv_install {env_dir}/bin/python .'
    subprocess.run(["bash", "-c", install], cwd=REPO, check=True, timeout=300)
    return env_dir


def run(env_dir: Path, *argv: str, secret: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "NEURON_DISAGG_SECRET")}
    if secret:
        env["NEURON_DISAGG_SECRET"] = secret
    return subprocess.run([str(env_dir / "bin" / argv[0]), *argv[1:]], capture_output=True, text=True,
                          timeout=120, env=env, cwd=env_dir.parent)


def test_the_base_install_brings_only_the_connectors_dependencies(base_env):
    listed = run(base_env, "python", "-c", "import importlib.metadata as m, json; "
                 "print(json.dumps(sorted({d.metadata['Name'].lower().replace('_', '-') for d in m.distributions()})))")
    installed = set(json.loads(listed.stdout)) - {"pip", "setuptools"}
    assert installed == BASE, sorted(installed ^ BASE)


def test_the_base_install_imports_its_layers_without_an_extra(base_env):
    imported = run(base_env, "python", "-c",
                   "import sys, neuron_disagg.config, neuron_disagg.kv_params, neuron_disagg.protocol, "
                   "neuron_disagg.doctor, neuron_disagg.vllm.serve; "
                   "print(sorted({m.split('.')[0] for m in sys.modules} & "
                   "{'aiohttp', 'prometheus_client', 'httpx', 'rich', 'matplotlib', 'boto3', 'ray'}))")
    assert imported.returncode == 0 and imported.stdout.strip() == "[]", imported.stderr


def test_doctor_runs_from_the_base_install_and_says_vllm_is_missing(base_env):
    doctor = run(base_env, "neuron-disagg", "doctor", "--json")
    report = json.loads(doctor.stdout)
    assert doctor.returncode == 1 and not report["ok"]
    assert any(c["status"] == "fail" and "vllm" in (c["name"] + c["message"]).lower() for c in report["checks"])


def test_serve_from_the_base_install_stops_on_the_missing_vllm_with_a_reason(base_env, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("side_channel_port: 5600\n")
    serve = run(base_env, "neuron-disagg", "serve", "prefill", "model", "--config", str(config),
                secret="0123456789abcdef0123456789abcdef")
    assert serve.returncode != 0 and "vllm" in serve.stderr.lower() and "Traceback" not in serve.stderr, serve.stderr


def test_the_router_from_the_base_install_names_its_extra(base_env):
    router = run(base_env, "neuron-disagg", "router", "--prefill", "http://p:1", "--decode", "http://d:1")
    assert router.returncode == 2 and "pip install 'neuron-disagg[router]'" in router.stderr, router.stderr
