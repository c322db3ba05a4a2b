"""The package on Python 3.14, the Python of Neuron's 2.33 DLAMI: in ./.venv-py3.14
(scripts/python_env.sh: CPython built from Debian's source, the test extras, NIXL 1.4.1, no torch
and no vLLM, which have no 3.14 build here), the fast check and the cross-process transfer tests
over UCX pass, and what is skipped is only what needs vLLM, torch or a GPU. In the extended tier."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYTHON = REPO / ".venv-py3.14" / "bin" / "python"
#: The only reasons a test may skip there: what has no 3.14 build on these indexes, and the GPU.
ABSENT = ("vLLM", "torch", "transformers", "vllm", "CUDA GPU")
TRANSFER_TESTS = ("tests/integration/test_push_transfer.py", "tests/integration/test_pull_transfer.py",
                  "tests/integration/test_push_faults.py", "tests/integration/test_push_streaming.py")

pytestmark = [pytest.mark.integration, pytest.mark.extended]


def _pytest(*args: str) -> subprocess.CompletedProcess:
    if not PYTHON.exists():
        raise RuntimeError(f"no Python 3.14 environment at {PYTHON.parent.parent}: run `bash scripts/python_env.sh`")
    return subprocess.run([str(PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=1800)


def _passed(done: subprocess.CompletedProcess) -> int:
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, f"{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
    passed = re.search(r"(\d+) passed", summary)
    assert passed, summary
    return int(passed.group(1))


def test_the_fast_check_passes_on_python_3_14_skipping_only_what_has_no_3_14_build():
    done = _pytest("-n", "2", "-m", "not integration and not slow")
    assert _passed(done) > 700
    skips = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert all(any(word in line for word in ABSENT) for line in skips), skips


def test_the_transfer_tests_pass_on_python_3_14_over_ucx():
    done = _pytest(*TRANSFER_TESTS, "-k", "UCX and not nixl")
    assert _passed(done) == 27
