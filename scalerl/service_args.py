"""What the services' own command lines share (`scalerl-sandbox`, `scalerl-reward`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def bounded(kind: Callable[[str], float], low: float, high: float) -> Callable[[str], float]:
    """An argparse type: `kind(text)` within [low, high], else argparse's one-line error
    (exit status 2)."""

    def parse(text: str) -> float:
        value = kind(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low:g}, {high:g}], got {text}")
        return value

    return parse
