"""Who may import whom (docs/architecture.md): read from every module's import statements, so a
change that breaks the layering fails here rather than in review."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "neuron_disagg"


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute (relative imports resolved), at any depth."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.add(".".join([*base, node.module] if node.module else base))
            else:
                found.add(node.module)
    return found


def modules(layer: str) -> list[Path]:
    return sorted((PACKAGE / layer).rglob("*.py")) if (PACKAGE / layer).is_dir() else [PACKAGE / f"{layer}.py"]


def offenders(layer: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    bad = {}
    for path in modules(layer):
        hits = sorted(m for m in imports(path) if m.split(".")[0] in forbidden or m.startswith(forbidden))
        if hits:
            bad[str(path.relative_to(REPO))] = hits
    return bad


RULES = {
    # the pure core: no threads' libraries, no I/O stacks, nothing above it
    "protocol": ("vllm", "torch", "nixl", "neuron_disagg.transfer", "neuron_disagg.vllm", "neuron_disagg.router",
                 "neuron_disagg.platforms", "socket", "threading", "cuda_compat"),
    # threads and I/O: never vLLM, the router or the CUDA platform
    "transfer": ("vllm", "neuron_disagg.vllm", "neuron_disagg.router", "cuda_compat"),
    # the accelerator layer: the CUDA platform builds on it, not the reverse
    "platforms": ("vllm", "neuron_disagg.vllm", "neuron_disagg.transfer", "neuron_disagg.router", "cuda_compat"),
    # the router knows the params contract and the wire (it sends P a Withdraw over the side
    # channel), never an engine's internals or a rank's threads and agents
    "router": ("vllm", "torch", "nixl", "neuron_disagg.vllm", "neuron_disagg.transfer.rank",
               "neuron_disagg.transfer.transport", "neuron_disagg.transfer.writer", "neuron_disagg.transfer.receiver",
               "neuron_disagg.transfer.pull"),
    # Ray Serve's side: it shapes legs and starts Ray, as the router routes; no rank's threads
    "ray_serve": ("torch", "nixl", "neuron_disagg.transfer", "neuron_disagg.protocol", "neuron_disagg.platforms"),
}


@pytest.mark.parametrize("layer", list(RULES))
def test_each_layer_imports_only_what_lies_below_it(layer):
    assert offenders(layer, RULES[layer]) == {}


def test_only_the_vllm_package_imports_vllm():
    importers = {str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py")
                 if any(m.split(".")[0] == "vllm" for m in imports(p))}
    assert importers and all(p.startswith("neuron_disagg/vllm/") for p in importers), sorted(importers)


def test_only_the_ray_serve_package_imports_ray():
    importers = {str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py")
                 if any(m.split(".")[0] == "ray" for m in imports(p))}
    assert importers and all(p.startswith("neuron_disagg/ray_serve/") for p in importers), sorted(importers)


def test_the_rule_catches_an_import_it_forbids(tmp_path, monkeypatch):
    """The check itself can fail: a platforms module that imports cuda_compat is caught."""
    fake = tmp_path / "neuron_disagg" / "platforms"
    fake.mkdir(parents=True)
    (fake / "loop.py").write_text("from cuda_compat import CudaPlatform\nfrom ..vllm import connector\n")
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    monkeypatch.setitem(globals(), "PACKAGE", tmp_path / "neuron_disagg")
    assert offenders("platforms", RULES["platforms"]) == {
        "neuron_disagg/platforms/loop.py": ["cuda_compat", "neuron_disagg.vllm"]}
