"""DeadlineSettings (store/settings.py), the operation budget (store/deadline.py) and the retry
verdict on a deadline hit: pure."""

from __future__ import annotations

import time

import pytest

from tiered_ckpt.retry import is_retryable_s3_error
from tiered_ckpt.store.deadline import OperationBudget, RequestDeadlineError, RequestGuard
from tiered_ckpt.store.settings import DeadlineSettings


def test_defaults_fit_small_objects_and_let_a_multi_gib_part_through_a_slow_link() -> None:
    d = DeadlineSettings()
    assert (
        d.stall_timeout_s,
        d.deadline_base_s,
        d.min_rate_bytes_per_s,
        d.operation_budget_factor,
    ) == (60.0, 5.0, 256 * 1024, 3.0)
    assert d.deadline_s(300) == pytest.approx(5.0 + 300 / (256 * 1024))  # a latest pointer
    assert d.deadline_s(64 * 1024**2) == 5.0 + 256.0  # a 64 MiB part
    assert d.deadline_s(5 * 1024**3) == 5.0 + 20480.0  # 5 GiB at 256 KiB/s
    # one operation, every attempt and wait together
    assert d.operation_budget_s(300) == pytest.approx(3 * (5.0 + 300 / (256 * 1024)))
    assert d.operation_budget_s(64 * 1024**2) == 3 * 261.0


@pytest.mark.parametrize(
    "field",
    ["stall_timeout_s", "deadline_base_s", "min_rate_bytes_per_s", "operation_budget_factor"],
)
@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), True, "5"])
def test_bad_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        DeadlineSettings(**{field: value})  # type: ignore[arg-type]


def test_a_deadline_hit_is_retried_by_the_store() -> None:
    assert is_retryable_s3_error(
        RequestDeadlineError("get_object b/k: deadline of 3.0 s passed", seconds=3.0)
    )


def test_a_budget_factor_below_one_request_is_refused() -> None:
    with pytest.raises(ValueError, match="operation_budget_factor must be >= 1"):
        DeadlineSettings(operation_budget_factor=0.5)


def test_the_operation_budget_grows_with_the_largest_request_it_noted() -> None:
    settings = DeadlineSettings(deadline_base_s=2.0, min_rate_bytes_per_s=1000.0)
    budget = OperationBudget(settings, planned_bytes=1000)
    assert budget.limit_s == 3 * (2.0 + 1.0)
    budget.note(4.0)  # a request larger than planned (3 s): the budget follows it
    assert budget.limit_s == 3 * 4.0
    budget.note(1.0)  # a smaller one leaves it
    assert budget.limit_s == 12.0
    assert budget.left_s(budget.started + 5.0) == pytest.approx(7.0)
    assert budget.left_s(budget.started + 13.0) == pytest.approx(-1.0)


def _guard(settings: DeadlineSettings, budget: OperationBudget, **kwargs: int) -> RequestGuard:
    return RequestGuard(
        "get_object b/k",
        settings,
        request_bytes=kwargs.get("request_bytes", 0),
        expect_bytes=kwargs.get("expect_bytes", 0),
        stall_from_start=False,
        budget=budget,
    )


def test_a_request_running_when_the_budget_is_spent_is_cut() -> None:
    settings = DeadlineSettings(deadline_base_s=10.0, min_rate_bytes_per_s=1000.0)
    budget = OperationBudget(settings)  # 3 x 10 s
    budget.started -= 25.0  # earlier attempts took 25 s
    guard = _guard(settings, budget)  # this attempt: its own deadline is 10 s
    now = time.monotonic()
    assert not guard.check(now + 4.0)
    assert guard.check(now + 5.5)  # 30.5 s into the operation, 5.5 s into the request
    assert guard.reason == "operation budget of 30.0 s spent" and guard.limit_s == 30.0
    assert isinstance(guard.error(), RequestDeadlineError)


def test_the_budget_follows_bytes_known_not_the_range_asked_for() -> None:
    settings = DeadlineSettings(deadline_base_s=1.0, min_rate_bytes_per_s=1000.0)
    budget = OperationBudget(settings)
    guard = _guard(settings, budget, expect_bytes=1_000_000)  # a Range of a kind's cap
    guard.check(budget.started)
    assert budget.limit_s == 3 * 1.0  # before the headers: the Range is no knowledge
    guard.body_started(5000)  # Content-Length: 5000
    guard.check(budget.started)
    assert budget.limit_s == 3 * (1.0 + 5.0)
    put = _guard(settings, budget, request_bytes=20_000)  # a body sent is known
    put.check(budget.started)
    assert budget.limit_s == 3 * (1.0 + 20.0)
