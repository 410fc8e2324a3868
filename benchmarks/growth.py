"""How a cost grows with the world size N: least-squares fits of constant, log, linear and quadratic
models to measured (N, seconds) points, the simplest that fits chosen, and its projection to a larger N.

Pure (numpy only): `benchmarks/ranks.py` fits every phase of an elastic event with it.

The models are nested in what they can bend to (a quadratic never fits worse than a line), so the one
with the least residual is nearly always the quadratic. The choice is therefore the model with the
fewest coefficients whose residual (root mean square) is within the tolerance of the best model's:
more curvature must buy more than the box's noise to be believed. A model whose highest term has a
negative coefficient is not a model of a cost's growth (projected far enough, the cost turns negative):
only the constant, or a fit whose highest coefficient is >= 0, is chosen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import numpy as np


class Growth(StrEnum):
    """A model of a cost against N, in order of the coefficients it has."""

    CONSTANT = "constant"
    LOG = "log"
    LINEAR = "linear"
    QUADRATIC = "quadratic"


_TERMS = {Growth.CONSTANT: lambda n: [1.0], Growth.LOG: lambda n: [1.0, math.log(n)],
          Growth.LINEAR: lambda n: [1.0, float(n)], Growth.QUADRATIC: lambda n: [1.0, float(n), float(n) ** 2]}
FORMULA = {Growth.CONSTANT: "a", Growth.LOG: "a + b·ln N", Growth.LINEAR: "a + b·N",
           Growth.QUADRATIC: "a + b·N + c·N²"}


@dataclass(frozen=True, slots=True)
class Fit:
    """One model fitted to the points: its coefficients (a, b, c as `FORMULA` names them) and residual."""

    growth: Growth
    coefficients: tuple[float, ...]
    rms_s: float
    """Root mean square of the residuals, in seconds."""

    def at(self, n: float) -> float:
        """The fitted cost at world size `n`."""
        return float(np.dot(self.coefficients, _TERMS[self.growth](n)))

    def to_dict(self) -> dict:
        return {"growth": str(self.growth), "formula": FORMULA[self.growth], "coefficients": list(self.coefficients),
                "rms_s": self.rms_s}


@dataclass(frozen=True, slots=True)
class Choice:
    """Every model's fit to one phase's points and the one chosen."""

    fits: tuple[Fit, ...]
    best: Fit

    def to_dict(self, project_to: int) -> dict:
        return {"best": self.best.to_dict(), f"projected_{project_to}_s": self.best.at(project_to),
                "fits": [f.to_dict() for f in self.fits]}


def fit(ns: list[int], ys: list[float], growth: Growth) -> Fit:
    """Least-squares fit of `growth` to the points (ns[i], ys[i])."""
    k = len(_TERMS[growth](1))
    if len(ns) != len(ys):
        raise ValueError(f"{len(ns)} sizes but {len(ys)} costs: give one cost per size")
    if len(ns) < k:
        raise ValueError(f"a {growth} fit needs at least {k} points, got {len(ns)}")
    if min(ns) <= 0:
        raise ValueError(f"world sizes must be positive, got {ns}")
    a = np.array([_TERMS[growth](n) for n in ns], dtype=float)
    y = np.array(ys, dtype=float)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    rms = float(np.sqrt(np.mean((a @ coef - y) ** 2)))
    return Fit(growth=growth, coefficients=tuple(float(c) for c in coef), rms_s=rms)


def choose(ns: list[int], ys: list[float], *, tolerance_s: float = 0.01, tolerance_rel: float = 0.1) -> Choice:
    """Every model the points over-determine (more distinct sizes than it has coefficients: one it fits
    exactly has shown nothing), fitted; the chosen one is the simplest growing model
    whose residual is within the tolerance of the least residual among them: `tolerance_s` seconds or
    `tolerance_rel` of the points' mean, whichever is larger (the noise a phase's figure carries on a
    shared box)."""
    fits = tuple(fit(ns, ys, g) for g in Growth if len(set(ns)) > len(_TERMS[g](1)))
    if not fits:
        raise ValueError(f"no model can be fitted to {len(set(ns))} distinct sizes")
    growing = [f for f in fits if f.growth == Growth.CONSTANT or f.coefficients[-1] >= 0]
    least = min(f.rms_s for f in growing)
    tolerance = max(tolerance_s, tolerance_rel * float(np.mean(np.abs(ys))))
    best = next(f for f in growing if f.rms_s <= least + tolerance)
    return Choice(fits=fits, best=best)
