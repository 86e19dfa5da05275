"""The step-time model behind the scheduler's latency-targeted budget."""

from __future__ import annotations

import pytest
from ferrum_client.step_cost import StepCostModel


def test_fit_recovers_an_affine_cost_and_sizes_steps_to_the_target() -> None:
    model = StepCostModel()
    for tokens in (64, 512, 100, 300, 480, 70, 256):
        model.observe(tokens, 0.020 + 0.0005 * tokens)  # 20 ms fixed + 0.5 ms per token
    fitted = model.fit()
    assert fitted is not None
    assert fitted[0] == pytest.approx(0.020, rel=1e-6)
    assert fitted[1] == pytest.approx(0.0005, rel=1e-6)
    # (0.2 - 0.02) / 0.0005 = 360 tokens fit in a 200 ms step.
    assert model.budget(0.2, ceiling=512, floor=64) == 360
    assert model.budget(1.0, ceiling=512, floor=64) == 512  # never above the ceiling
    assert model.budget(0.01, ceiling=512, floor=64) == 64  # never below the floor


def test_no_budget_is_predicted_before_enough_steps() -> None:
    model = StepCostModel(min_observations=4)
    for tokens in (100, 200, 300):
        model.observe(tokens, tokens * 0.001)
    assert model.fit() is None
    assert model.budget(0.05, ceiling=512, floor=16) == 512
    model.observe(400, 0.4)
    assert model.budget(0.05, ceiling=512, floor=16) == 50


def test_equal_sized_steps_charge_all_time_per_token_and_bad_samples_are_ignored() -> None:
    model = StepCostModel()
    for _ in range(6):
        model.observe(512, 0.256)
    model.observe(0, 1.0)  # an empty step or a missing timing teaches nothing
    model.observe(100, 0.0)
    assert model.fit() == pytest.approx((0.0, 0.0005))
    assert model.budget(0.128, ceiling=1024, floor=1) == 256


def test_recent_steps_outweigh_old_ones() -> None:
    model = StepCostModel(decay=0.5)
    for tokens in (100, 400, 200, 300):
        model.observe(tokens, 0.001 * tokens)  # a slow phase ...
    for tokens in (100, 400, 200, 300, 150, 350, 250, 120, 380, 220):
        model.observe(tokens, 0.0002 * tokens)  # ... then five times faster
    fitted = model.fit()
    assert fitted is not None
    assert fitted[1] < 0.0003


def test_scheduler_config_rejects_negative_times() -> None:
    from ferrum_client.scheduler import SchedulerConfig

    for bad in ({"target_step_ms": -1.0}, {"max_first_token_hold_ms": -1.0}):
        with pytest.raises(ValueError):
            SchedulerConfig(**bad)  # type: ignore[arg-type]
    assert SchedulerConfig(max_first_token_hold_ms=0).max_first_token_hold_ms == 0
