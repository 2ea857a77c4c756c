"""Argument types for the commands: each refuses what it cannot use with a message that says
what is accepted, which argparse prints as the command's one-line error (exit status 2)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive(text: str) -> float:
    """A finite number above 0 (seconds, GiB)."""
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number above 0")
    return value


def non_negative(text: str) -> float:
    """A finite number of at least 0 (seconds to wait)."""
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of at least 0")
    return value


def fraction(text: str) -> float:
    """A finite number from 0 to 1 (a rate)."""
    value = _number(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number from 0 to 1")
    return value


def integer(low: int, high: int) -> Callable[[str], int]:
    """An integer in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"{value} is out of range: accepted values are {low} to {high:,}"
            )
        return value

    parse.__name__ = f"integer from {low} to {high}"
    return parse


def at_most(parse: Callable[[str], float], high: float) -> Callable[[str], float]:
    """``parse``, then at most ``high``."""

    def bounded(text: str) -> float:
        value = parse(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"{text!r} is over the limit of {high:g}")
        return value

    bounded.__name__ = parse.__name__
    return bounded
