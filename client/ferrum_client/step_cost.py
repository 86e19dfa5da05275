"""A running model of step time against step size, for a latency-targeted token budget.

A step's forward time is close to affine in its token count: a fixed part (per-step overheads,
the LM head and attention of the decodes it carries) plus a per-token part (the GEMMs). The
scheduler fits ``seconds = fixed + per_token * tokens`` by exponentially weighted least squares
over the executor's own ``StepTimings`` and sizes the next step so it is predicted to take at most
the target: every running request then waits at most about one target between tokens, whatever
the dtype or device speed, instead of whatever a fixed token budget happens to cost.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepCostModel"]


@dataclass(slots=True)
class StepCostModel:
    # Weight kept by past observations per new one: ~1 / (1 - decay) steps of memory.
    decay: float = 0.9
    # Fits need a spread of step sizes; below this many observations no budget is predicted.
    min_observations: int = 4
    _w: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0
    _count: int = 0

    def observe(self, tokens: int, seconds: float) -> None:
        """Record one finished step of `tokens` tokens that took `seconds` on the executor."""
        if tokens <= 0 or seconds <= 0:
            return
        d = self.decay
        x, y = float(tokens), seconds
        self._w = d * self._w + 1.0
        self._sx = d * self._sx + x
        self._sy = d * self._sy + y
        self._sxx = d * self._sxx + x * x
        self._sxy = d * self._sxy + x * y
        self._count += 1

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None until enough varied steps were seen."""
        if self._count < self.min_observations or self._w <= 0:
            return None
        mean_x, mean_y = self._sx / self._w, self._sy / self._w
        var_x = self._sxx / self._w - mean_x * mean_x
        if var_x <= 1e-9 * max(mean_x * mean_x, 1.0):
            # Every step had the same size: all time is attributed per token.
            return (0.0, mean_y / mean_x) if mean_x > 0 else None
        slope = (self._sxy / self._w - mean_x * mean_y) / var_x
        if slope <= 0:
            return (0.0, mean_y / mean_x)
        return max(0.0, mean_y - slope * mean_x), slope

    def budget(self, target_seconds: float, ceiling: int, floor: int) -> int:
        """Most tokens a step may hold to take about `target_seconds`, within [floor, ceiling]
        (floor wins over ceiling); the ceiling until the model has a fit."""
        fitted = self.fit()
        if fitted is None:
            return max(floor, ceiling)
        fixed, per_token = fitted
        # The epsilon keeps an exact fit (359.99999 tokens) from losing a token to rounding.
        tokens = int((target_seconds - fixed) / per_token + 1e-6) if per_token > 0 else ceiling
        return max(floor, min(ceiling, tokens))
