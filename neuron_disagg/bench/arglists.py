"""Comma-separated number lists on the command line (`--rates 1,2,4`, `--input-lens 1024,16384`),
for `neuron-disagg bench`."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def positive_list(kind: type, what: str) -> Callable[[str], list]:
    """An argparse ``type`` for a non-empty comma-separated list of positive ``kind`` values."""

    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a comma-separated list, got {text!r}") from None
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"{what} must be positive numbers, got {text!r}")
        return values

    return parse
