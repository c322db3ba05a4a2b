"""The llm-d examples for EKS (examples/llm-d/): valid Kubernetes 1.33 objects (EKS's), checked
offline against the API's own schemas (kubernetes-validate), and what they run is what this
package accepts: the config parses, the secret comes from a Secret, never a literal, each pod
passes its own address, and the D pods carry llm-d's sidecar with the NIXL v2 connector."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from neuron_disagg.config import Config
from neuron_disagg.vllm import serve

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples" / "llm-d").glob("*.yaml"))
KUBERNETES = "1.33.0"


def objects(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_there_is_one_example_per_platform():
    assert [p.name for p in EXAMPLES] == ["qwen3-32b-p5en.yaml", "qwen3-32b-trn2.yaml"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_object_is_valid_kubernetes(path):
    for obj in objects(path):
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_the_pods_run_our_connector_with_the_config_and_secret_it_needs(path, tmp_path, monkeypatch):
    pytest.importorskip("vllm", reason="serve (run below) needs vLLM, installed by scripts/setup.sh")
    docs = objects(path)
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    (tmp_path / "config.yaml").write_text(config_map["data"]["config.yaml"])
    config = Config.from_yaml(tmp_path / "config.yaml")
    assert config.accept_unsigned_prefill_legs  # the sidecar's P legs carry vLLM's params, unsigned
    deployments = {d["metadata"]["labels"]["llm-d.ai/role"]: d for d in docs if d["kind"] == "Deployment"}
    assert set(deployments) == {"prefill", "decode"}
    for role, deployment in deployments.items():
        pod = deployment["spec"]["template"]["spec"]
        vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
        command = vllm["command"]
        assert command[:4] == ["neuron-disagg", "serve", role, "Qwen/Qwen3-32B"]
        assert command[command.index("--side-channel-host") + 1] == "$(POD_IP)"
        env = {e["name"]: e for e in vllm["env"]}
        assert env[config.secret_env]["valueFrom"]["secretKeyRef"]["name"] == "neuron-disagg-secret"
        assert all("value" not in e or "secret" not in e["name"].lower() for e in vllm["env"])
        mounted = {m["mountPath"] for m in vllm["volumeMounts"]}
        assert str(Path(command[command.index("--config") + 1]).parent) in mounted
        monkeypatch.setenv(config.secret_env, "s" * 32)  # what `serve` would exec: it accepts these flags
        ours = command[2:command.index("--")]
        args = [a if a != "$(POD_IP)" else "10.0.0.9" for a in ours]
        args[args.index("--config") + 1] = str(tmp_path / "config.yaml")
        assert serve.main([*args, "--dry-run", "--", *command[command.index("--") + 1:]]) == 0
    sidecar = next(c for c in deployments["decode"]["spec"]["template"]["spec"]["containers"] if c["name"] == "routing-sidecar")
    assert "--connector=nixlv2" in sidecar["args"]
    assert "--vllm-port=8200" in sidecar["args"] and "8200" in command  # the D container's port
