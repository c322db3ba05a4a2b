"""The H200 device check (scripts/h200_check.py) in its dry-run mode: host memory in place of VRAM and
a worker thread in place of the GPU's queue, everything else as on the device — rank processes, the
connector's geometry reading, the real writer and receiver threads over NIXL UCX. So the script
cannot rot between the sessions that are lent an H200."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "h200_check.py"


def test_the_device_check_passes_its_dry_run_and_its_controls_show_the_races():
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    checks = {c["check"]: c for c in report["checks"]}
    assert report["ok"] and report["dry_run"] and len(checks) == 10, list(checks)
    assert checks["platform"]["platform"] == "cpu"
    for name in ("P fence: KV written behind a delayed kernel", "D fence: fresh blocks zeroed behind a delay",
                 "P fence, streamed: a chunk written behind the step's kernel",
                 "P fence, by layers: each group written behind its layers' kernels"):
        assert checks[name]["control_shows_race"], f"{name}: without the fence the race must show"
    assert {"TP 1 -> 2, LBHNC", "TP 2 -> 1, LBHNC"} <= set(checks)
    assert checks["BLHNC: a run of blocks one descriptor for every layer"]["descriptors"] == 2
