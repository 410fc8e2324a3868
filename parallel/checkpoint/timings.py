"""Where a save or a load spent its time: the manager's public seam for benchmarks and logs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Timings:
    """Where the last save or load spent its time on this rank (seconds; `bytes` written or read). A
    public seam for benchmarks and logs."""

    phases: dict[str, float] = field(default_factory=dict)
    bytes: int = 0

    def add(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds
