"""Who may import whom (docs/architecture.md): read from every module's import statements, so a
change that breaks the layering fails here rather than in review."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "neuron_disagg"


def import_statements(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """Every import in ``path``, at any depth, as (module, the names taken from it): absolute, with
    relative imports resolved; a plain ``import m`` takes no names."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found: list[tuple[str, tuple[str, ...]]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.extend((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names = tuple(alias.name for alias in node.names)
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.append((".".join([*base, node.module] if node.module else base), names))
            else:
                found.append((node.module, names))
    return found


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute (relative imports resolved), at any depth."""
    return {module for module, _ in import_statements(path)}


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
    # Ray Serve's side: it shapes legs and starts Ray, as the router routes; no rank's threads, and
    # never the launcher that starts it
    "ray_serve": ("torch", "nixl", "neuron_disagg.transfer", "neuron_disagg.protocol", "neuron_disagg.platforms",
                  "neuron_disagg.local_cluster"),
    # the launcher of one-host clusters (demo, tests, bench): it knows what it starts by command
    # line, never by what runs inside, and never the commands that use it
    "local_cluster": ("vllm", "torch", "nixl", "ray", "neuron_disagg.transfer", "neuron_disagg.protocol",
                      "neuron_disagg.platforms", "neuron_disagg.router", "neuron_disagg.vllm.connector",
                      "neuron_disagg.vllm.plugin", "neuron_disagg.bench", "neuron_disagg.demo", "neuron_disagg.cli",
                      "neuron_disagg.deploy"),
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


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph() -> dict[str, set[str]]:
    """Each of the package's modules -> the package's modules it imports. ``from . import x`` imports
    module ``x`` where there is one; an import inside a function or under TYPE_CHECKING counts too,
    as either still ties the two modules together."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        targets = set()
        for module, names in import_statements(path):
            for taken in names or ("",):
                submodule = f"{module}.{taken}"
                targets.add(submodule if submodule in paths else module)
        graph[name] = (targets & paths.keys()) - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph.get(module, ()):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(cycles)


def test_no_two_modules_of_the_package_import_each_other_even_through_others():
    assert import_cycles(module_graph()) == []


def test_the_cycle_check_catches_cycles_through_lazy_and_type_checking_imports(tmp_path, monkeypatch):
    """The check itself can fail: a launcher importing an app that imports the launcher back from
    inside a function is one cycle, a pool and the policy that names the pool's type only for the
    type checker another; a module a cycle only points at is in neither."""
    fake = tmp_path / "neuron_disagg"
    (fake / "serve").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "serve" / "__init__.py").write_text("")
    (fake / "launcher.py").write_text("from .serve import app\nfrom . import config\n")
    (fake / "config.py").write_text("import os\n")
    (fake / "serve" / "app.py").write_text("def main():\n    from ..launcher import FABRIC\n")
    (fake / "pool.py").write_text("from .policy import best\n")
    (fake / "policy.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from .pool import Pool\n")
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    assert import_cycles(module_graph()) == [["neuron_disagg.launcher", "neuron_disagg.serve.app"],
                                             ["neuron_disagg.policy", "neuron_disagg.pool"]]
