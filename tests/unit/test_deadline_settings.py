"""DeadlineSettings (store/settings.py) and the retry verdict on a deadline hit:
pure."""

from __future__ import annotations

import pytest

from tiered_ckpt.retry import is_retryable_s3_error
from tiered_ckpt.store.deadline import RequestDeadlineError
from tiered_ckpt.store.settings import DeadlineSettings


def test_defaults_fit_small_objects_and_let_a_multi_gib_part_through_a_slow_link() -> None:
    d = DeadlineSettings()
    assert (d.stall_timeout_s, d.deadline_base_s, d.min_rate_bytes_per_s) == (
        60.0,
        15.0,
        256 * 1024,
    )
    assert d.deadline_s(300) == pytest.approx(15.0 + 300 / (256 * 1024))  # a latest pointer
    assert d.deadline_s(64 * 1024**2) == 15.0 + 256.0  # a 64 MiB part
    assert d.deadline_s(5 * 1024**3) == 15.0 + 20480.0  # 5 GiB at 256 KiB/s


@pytest.mark.parametrize("field", ["stall_timeout_s", "deadline_base_s", "min_rate_bytes_per_s"])
@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), True, "5"])
def test_bad_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        DeadlineSettings(**{field: value})  # type: ignore[arg-type]


def test_a_deadline_hit_is_retried_by_the_store() -> None:
    assert is_retryable_s3_error(
        RequestDeadlineError("get_object b/k: deadline of 3.0 s passed", seconds=3.0)
    )
