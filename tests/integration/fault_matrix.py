"""The fault tests' rows for docs/faults.md: printed, and appended to the file named by
NEURON_DISAGG_FAULT_MATRIX when set (the tables there come from such a run)."""

import os


def record(row: str) -> None:
    print(row)
    path = os.environ.get("NEURON_DISAGG_FAULT_MATRIX")
    if path:
        with open(path, "a") as out:
            out.write(row + "\n")
