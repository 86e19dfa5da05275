"""A running model of step time against what a step holds, for a latency-targeted budget.

A step's forward time is close to affine in what it carries: a fixed part (per-step overheads,
the weights read once whatever the batch), a part per decode (one token that attends over its
whole context) and a part per prefill token (mostly GEMM work). The two per-token parts differ:
2.2 against 1.4 ms in mixed steps on this project's CPU benchmark model, and far more on a GPU,
where a decode reads its whole KV for one token. The scheduler fits

    seconds = fixed + per_decode * decodes + per_prefill_token * prefill_tokens

by exponentially weighted least squares over the executor's own ``StepTimings``, and sizes the
prefill of the next step from it: what is left of the target after the decodes, and never less
than a guaranteed share of the target, so that prompts keep starting while the decodes alone
already take longer than the target.

Until the two kinds of token have varied independently (a run of decode-only steps, say) their
costs cannot be told apart; the model then falls back to one slope for every token, which is
what a step of the same mix as the recent ones costs.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepCost", "StepCostModel"]

# Decodes and prefill tokens must vary apart from each other by at least this much (one minus
# the squared correlation of the two over the remembered steps) for separate costs to be fitted.
MIN_INDEPENDENCE = 0.05


@dataclass(frozen=True, slots=True)
class StepCost:
    """Fitted seconds: fixed per step, per decode, per prefill token."""

    fixed_s: float
    per_decode_s: float
    per_prefill_token_s: float

    def seconds(self, decodes: int, prefill_tokens: int) -> float:
        prefill = self.per_prefill_token_s * prefill_tokens
        return self.fixed_s + self.per_decode_s * decodes + prefill


@dataclass(slots=True)
class StepCostModel:
    # Weight kept by past observations per new one: ~1 / (1 - decay) steps of memory.
    decay: float = 0.9
    # Fits need a spread of step sizes; below this many observations no budget is predicted.
    min_observations: int = 4
    _w: float = 0.0
    _sd: float = 0.0
    _sp: float = 0.0
    _sy: float = 0.0
    _sdd: float = 0.0
    _spp: float = 0.0
    _sdp: float = 0.0
    _sdy: float = 0.0
    _spy: float = 0.0
    _count: int = 0

    def observe(self, decodes: int, prefill_tokens: int, seconds: float) -> None:
        """Record one finished step of `decodes` decodes and `prefill_tokens` prefill tokens
        that took `seconds` on the executor."""
        if decodes < 0 or prefill_tokens < 0 or decodes + prefill_tokens <= 0 or seconds <= 0:
            return
        k = self.decay
        d, p, y = float(decodes), float(prefill_tokens), seconds
        self._w = k * self._w + 1.0
        self._sd = k * self._sd + d
        self._sp = k * self._sp + p
        self._sy = k * self._sy + y
        self._sdd = k * self._sdd + d * d
        self._spp = k * self._spp + p * p
        self._sdp = k * self._sdp + d * p
        self._sdy = k * self._sdy + d * y
        self._spy = k * self._spy + p * y
        self._count += 1

    def fit(self) -> StepCost | None:
        """The fitted costs, or None until enough steps were seen."""
        if self._count < self.min_observations or self._w <= 0:
            return None
        w = self._w
        md, mp, my = self._sd / w, self._sp / w, self._sy / w
        vdd = self._sdd / w - md * md
        vpp = self._spp / w - mp * mp
        vdp = self._sdp / w - md * mp
        cdy = self._sdy / w - md * my
        cpy = self._spy / w - mp * my
        det = vdd * vpp - vdp * vdp
        scale = max(md * md, 1.0) * max(mp * mp, 1.0)
        if vdd > 1e-9 and vpp > 1e-9 and det > MIN_INDEPENDENCE * vdd * vpp and det > 1e-12 * scale:
            per_decode = (cdy * vpp - cpy * vdp) / det
            per_prefill = (cpy * vdd - cdy * vdp) / det
            # Noise can fit a negative cost (a step that got cheaper by carrying more): such a
            # fit predicts nothing useful, so the single slope stands in for it.
            if per_decode >= 0 and per_prefill > 0:
                fixed = max(0.0, my - per_decode * md - per_prefill * mp)
                return StepCost(fixed, per_decode, per_prefill)
        return self._one_slope(md + mp, vdd + vpp + 2 * vdp, cdy + cpy, my)

    @staticmethod
    def _one_slope(mean_x: float, var_x: float, cov_xy: float, mean_y: float) -> StepCost | None:
        """One cost for every token of a step (decode or prefill), fitted on their sum."""
        if mean_x <= 0:
            return None
        # Steps all of one size (or a slope that noise made negative) tell no fixed part apart:
        # all time is then attributed per token.
        if var_x <= 1e-9 * max(mean_x * mean_x, 1.0) or cov_xy <= 0:
            slope = mean_y / mean_x
            return StepCost(0.0, slope, slope)
        slope = cov_xy / var_x
        return StepCost(max(0.0, mean_y - slope * mean_x), slope, slope)

    def prefill_budget(
        self, target_seconds: float, decodes: int, min_share: float, floor: int
    ) -> int | None:
        """Prefill tokens a step of `decodes` decodes may add to take about `target_seconds`:
        what the decodes leave of the target, but at least what `min_share` of the target buys
        and at least `floor`. None until the model has a fit (the caller's ceiling applies)."""
        cost = self.fit()
        if cost is None:
            return None
        seconds = max(target_seconds - cost.seconds(decodes, 0), min_share * target_seconds)
        # The epsilon keeps an exact fit (359.99999 tokens) from losing a token to rounding.
        tokens = int(seconds / cost.per_prefill_token_s + 1e-6) if seconds > 0 else 0
        return max(floor, tokens)
