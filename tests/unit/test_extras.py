"""What the base install carries, and what a command says when its extra is missing.

A vLLM environment installs only the base package (connector, serve, doctor): read from the import
statements, nothing those reach may import a module that an extra brings. The clean-environment
install itself is checked in tests/integration/test_base_install.py."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from neuron_disagg import cli

REPO = Path(__file__).resolve().parents[2]
BASE_ENTRY_POINTS = ("neuron_disagg.vllm.plugin", "neuron_disagg.vllm.connector", "neuron_disagg.vllm.serve",
                     "neuron_disagg.doctor", "neuron_disagg.platforms.fabric_libs")


def _source(module: str) -> Path | None:
    path = REPO.joinpath(*module.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.exists():
            return candidate
    return None


def _imported_by(module: str) -> set[str]:
    """Every module ``module`` imports at any depth, relative imports resolved, and ``from P import M``
    counted as importing P.M where M is a module of ours."""
    path = _source(module)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *([node.module] if node.module else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if _source(f"{base}.{alias.name}"))
    return found


def third_party_reached(*entry_points: str) -> dict[str, str]:
    """Each non-package top-level module reached from ``entry_points``, with one module of ours that imports it."""
    seen: set[str] = set()
    reached: dict[str, str] = {}
    stack = list(entry_points)
    while stack:
        module = stack.pop()
        if module in seen or _source(module) is None:
            continue
        seen.add(module)
        parent = module.rpartition(".")[0]
        if parent:
            stack.append(parent)  # a package's __init__ runs before its modules
        for name in _imported_by(module):
            if name.split(".")[0] in ("neuron_disagg", "cuda_compat"):
                stack.append(name)
            else:
                reached.setdefault(name.split(".")[0], module)
    return reached


def test_the_base_install_reaches_no_module_an_extra_brings():
    reached = third_party_reached(*BASE_ENTRY_POINTS)
    brought = set().union(*cli.EXTRA_MODULES.values())
    assert {m: by for m, by in reached.items() if m in brought} == {}
    assert {"msgspec", "pydantic", "yaml", "numpy"} <= set(reached)


def test_the_walk_finds_what_the_router_needs_from_its_extra():
    """The check above can fail: from the router's command the same walk reaches aiohttp."""
    reached = third_party_reached("neuron_disagg.router.cli")
    assert "aiohttp" in reached and "prometheus_client" in reached, sorted(reached)


@pytest.mark.parametrize("command, blocked, extra", [
    (["router", "--prefill", "http://p:1", "--decode", "http://d:1"], "aiohttp", "router"),
    (["bench", "--help"], "matplotlib", "bench"),
    (["bench", "--help"], "rich", "bench"),
    (["launch", "config.yaml", "--dry-run"], "boto3", "deploy"),
    (["ray-serve", "model"], "ray", "ray"),
    (["demo"], "httpx", "demo"),
    (["demo", "--in-process"], "rich", "demo"),
])
def test_a_command_without_its_extra_says_which_extra_to_install(command, blocked, extra, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, blocked, None)  # as if not installed: ``import blocked`` fails
    assert cli.main(command) == 2
    message = capsys.readouterr().err
    assert f"pip install 'neuron-disagg[{extra}]'" in message and blocked in message, message


def test_the_base_commands_need_no_extra():
    assert {name for name, command in cli.COMMANDS.items() if command.extra is None} == {
        "serve", "doctor", "install-fabric-libs"}


def test_each_extras_modules_are_the_ones_pyproject_installs():
    """The modules checked before a command starts are those its extra lists in pyproject.toml."""
    import tomllib
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def distributions(extra: str) -> set[str]:
        names: set[str] = set()
        for requirement in extras[extra]:
            name = requirement.split("[")[0].split(">")[0].split("=")[0].strip()
            if name == "neuron-disagg":
                names |= set().union(*(distributions(e) for e in requirement.split("[")[1].rstrip("]").split(",")))
            else:
                names.add(name)
        return names

    module_of = {"aiohttp": "aiohttp", "prometheus_client": "prometheus_client", "httpx": "httpx", "rich": "rich",
                 "matplotlib": "matplotlib", "boto3": "boto3", "ray": "ray", "pyzmq": "zmq",
                 "pandas": "pandas"}
    for extra, modules in cli.EXTRA_MODULES.items():
        assert {module_of[d] for d in distributions(extra)} == set(modules) - {"botocore"}, extra
