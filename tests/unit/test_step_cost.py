"""The step-time model behind the scheduler's latency-targeted budget."""

from __future__ import annotations

import pytest
from ferrum_client.step_cost import StepCost, StepCostModel


def _steps(model: StepCostModel, steps: list[tuple[int, int]], cost: StepCost) -> None:
    for decodes, prefill in steps:
        model.observe(decodes, prefill, cost.seconds(decodes, prefill))


# Decodes and prefill varying apart: a decode-only tail, prefill-only bursts, mixed steps.
VARIED = [(40, 0), (0, 512), (30, 100), (10, 400), (60, 32), (0, 256), (50, 0), (20, 200)]


def test_fit_recovers_separate_costs_for_decodes_and_prefill_tokens() -> None:
    truth = StepCost(0.020, 0.004, 0.0002)  # 20 ms + 4 ms a decode + 0.2 ms a prefill token
    model = StepCostModel()
    _steps(model, VARIED, truth)
    fitted = model.fit()
    assert fitted is not None
    assert fitted.fixed_s == pytest.approx(0.020, rel=1e-6)
    assert fitted.per_decode_s == pytest.approx(0.004, rel=1e-6)
    assert fitted.per_prefill_token_s == pytest.approx(0.0002, rel=1e-6)
    # 30 decodes take 140 ms of a 200 ms target: the other 60 ms buy 300 prefill tokens.
    assert model.prefill_budget(0.2, 30, min_share=0.25, floor=32) == 300
    # 50 decodes take 220 ms, past the target: prefill still gets its quarter (50 ms).
    assert model.prefill_budget(0.2, 50, min_share=0.25, floor=32) == 250
    # Without a guaranteed share, only the floor.
    assert model.prefill_budget(0.2, 50, min_share=0.0, floor=32) == 32
    # Nothing decoding: the whole target less the fixed part.
    assert model.prefill_budget(0.2, 0, min_share=0.25, floor=32) == 900


def test_one_slope_fit_when_decodes_and_prefill_never_varied_apart() -> None:
    # Decode-only steps: nothing tells a prefill token's cost from a decode's.
    model = StepCostModel()
    _steps(model, [(d, 0) for d in (10, 40, 20, 30, 50)], StepCost(0.02, 0.004, 0.0))
    fitted = model.fit()
    assert fitted is not None
    assert fitted.per_decode_s == fitted.per_prefill_token_s == pytest.approx(0.004)
    assert fitted.fixed_s == pytest.approx(0.02)
    # Every step with the same mix (prefill = 8 x decodes): still one slope for both.
    model = StepCostModel()
    _steps(model, [(d, 8 * d) for d in (5, 10, 20, 40)], StepCost(0.01, 0.004, 0.0002))
    fitted = model.fit()
    assert fitted is not None
    assert fitted.per_decode_s == fitted.per_prefill_token_s
    # (4 ms + 8 x 0.2 ms) / 9 tokens: each token at the mixed steps' average price.
    assert fitted.per_prefill_token_s == pytest.approx(0.0056 / 9)


def test_no_budget_is_predicted_before_enough_steps() -> None:
    model = StepCostModel(min_observations=4)
    truth = StepCost(0.0, 0.001, 0.001)
    _steps(model, [(0, 100), (0, 200), (0, 300)], truth)
    assert model.fit() is None
    assert model.prefill_budget(0.05, 0, min_share=0.25, floor=16) is None
    _steps(model, [(0, 400)], truth)
    assert model.prefill_budget(0.05, 0, min_share=0.25, floor=16) == 50


def test_equal_sized_steps_charge_all_time_per_token_and_bad_samples_are_ignored() -> None:
    model = StepCostModel()
    for _ in range(6):
        model.observe(0, 512, 0.256)
    model.observe(0, 0, 1.0)  # an empty step or a missing timing teaches nothing
    model.observe(0, 100, 0.0)
    model.observe(-1, 100, 0.1)
    fitted = model.fit()
    assert fitted is not None
    assert (fitted.fixed_s, fitted.per_prefill_token_s) == pytest.approx((0.0, 0.0005))
    assert model.prefill_budget(0.128, 0, min_share=0.0, floor=1) == 256


def test_a_negative_fitted_cost_falls_back_to_one_slope() -> None:
    # Noisy steps where more decodes came out cheaper: no separate costs are trusted.
    model = StepCostModel()
    for decodes, prefill, seconds in [(10, 100, 0.20), (40, 100, 0.15), (20, 300, 0.30),
                                      (50, 250, 0.25), (30, 0, 0.08)]:  # fmt: skip
        model.observe(decodes, prefill, seconds)
    fitted = model.fit()
    assert fitted is not None
    assert fitted.per_decode_s == fitted.per_prefill_token_s > 0


def test_recent_steps_outweigh_old_ones() -> None:
    model = StepCostModel(decay=0.5)
    _steps(model, VARIED, StepCost(0.01, 0.005, 0.001))  # a slow phase ...
    _steps(model, VARIED * 2, StepCost(0.01, 0.001, 0.0002))  # ... then five times faster
    fitted = model.fit()
    assert fitted is not None
    assert fitted.per_prefill_token_s < 0.0003
    assert fitted.per_decode_s < 0.0015


def test_scheduler_config_rejects_negative_times_and_empty_steps() -> None:
    from ferrum_client.scheduler import SchedulerConfig

    for bad in (
        {"max_step_tokens": 0},
        {"max_prefill_step_tokens": 0},
        {"target_step_ms": -1.0},
        {"max_first_token_hold_ms": -1.0},
        {"min_prefill_share": -0.1},
        {"min_prefill_share": 1.5},
    ):
        with pytest.raises(ValueError):
            SchedulerConfig(**bad)  # type: ignore[arg-type]
    assert SchedulerConfig(max_first_token_hold_ms=0).max_first_token_hold_ms == 0
