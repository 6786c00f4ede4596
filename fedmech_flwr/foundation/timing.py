"""Seconds per named part of a diagnostic, recorded next to its results (benchmarks read them)."""

from __future__ import annotations

import time


class Clock:
    """``lap(name)`` adds the seconds since the previous lap (or since creation) to ``laps[name]``."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = self.laps.get(name, 0.0) + now - self._last
        self._last = now
