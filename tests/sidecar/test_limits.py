"""Per-team requests/min, tokens/min and concurrency limits, driven by an explicit clock."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from infermeter.config import TeamLimits
from sidecar.limits import Admission, LimitExceeded, RateLimiter

TEAM = "search"


def limiter(**limits: int) -> RateLimiter:
    """A limiter for one team with ``limits``, its buckets full at t=0."""
    return RateLimiter({TEAM: TeamLimits(**limits)}, now=0.0)


def refusal(lim: RateLimiter, reserve: int = 0, now: float = 0.0) -> LimitExceeded:
    """The LimitExceeded that admitting a request raises (the test fails if it is admitted)."""
    with pytest.raises(LimitExceeded) as caught:
        lim.admit(TEAM, reserve, now)
    return caught.value


def remaining_tokens(lim: RateLimiter, now: float = 0.0) -> int:
    """Tokens left in the team's bucket, read from the headers of a request reserving none."""
    return int(dict(lim.admit(TEAM, 0, now).headers)["x-ratelimit-remaining-tokens"])


@pytest.mark.parametrize("per_minute", [1, 3, 60])
def test_requests_bucket_refuses_the_request_over_the_limit(per_minute):
    """Within the same instant, request N+1 is refused and told to wait for one request's refill."""
    lim = limiter(requests_per_minute=per_minute)
    for _ in range(per_minute):
        lim.admit(TEAM, 0, 0.0)
    exc = refusal(lim)
    assert exc.reason == "requests"
    assert exc.retry_after_seconds == pytest.approx(60 / per_minute)


@pytest.mark.parametrize("per_minute", [1, 3, 60])
def test_requests_bucket_admits_again_once_retry_after_has_passed(per_minute):
    """Waiting exactly ``retry_after_seconds`` refills enough for one more request."""
    lim = limiter(requests_per_minute=per_minute)
    for _ in range(per_minute):
        lim.admit(TEAM, 0, 0.0)
    wait = refusal(lim).retry_after_seconds
    assert refusal(lim, now=wait * 0.99).reason == "requests"
    assert lim.admit(TEAM, 0, wait).team == TEAM


def test_tokens_bucket_reserves_prompt_estimate_plus_max_tokens():
    """An admitted request takes its whole reservation from the tokens bucket."""
    lim = limiter(tokens_per_minute=1000)
    lim.admit(TEAM, 300, 0.0)
    assert remaining_tokens(lim) == 700


def test_tokens_bucket_refuses_a_reservation_it_cannot_cover():
    """A reservation larger than what is left waits for the missing tokens to refill."""
    lim = limiter(tokens_per_minute=1000)
    lim.admit(TEAM, 700, 0.0)
    exc = refusal(lim, reserve=400)
    assert exc.reason == "tokens"
    assert exc.retry_after_seconds == pytest.approx(6.0)


@pytest.mark.parametrize(
    ("reserved", "used", "left"),
    [(600, 100, 900), (600, 600, 400), (600, 0, 1000), (600, 800, 200)],
    ids=["returns-unused", "exact", "returns-all", "takes-extra"],
)
def test_settle_replaces_the_reservation_by_real_usage(reserved, used, left):
    """Settling gives back what was reserved but unused, or takes what was used beyond it."""
    lim = limiter(tokens_per_minute=1000)
    lim.settle(lim.admit(TEAM, reserved, 0.0), used, 0.0)
    assert remaining_tokens(lim) == left


def test_usage_beyond_the_bucket_leaves_it_in_debt():
    """Using more than the bucket holds leaves a debt that must refill before the next request."""
    lim = limiter(tokens_per_minute=1000)
    lim.settle(lim.admit(TEAM, 600, 0.0), 1500, 0.0)
    assert refusal(lim, reserve=1).retry_after_seconds == pytest.approx(501 * 60 / 1000)


def test_request_bigger_than_the_bucket_passes_when_the_bucket_is_full():
    """A reservation above the whole bucket is admitted when full instead of refused forever."""
    lim = limiter(tokens_per_minute=1000)
    assert lim.admit(TEAM, 5000, 0.0).reserved_tokens == 5000


def test_request_bigger_than_the_bucket_waits_for_a_full_bucket():
    """A reservation above the whole bucket waits until the bucket is full again."""
    lim = limiter(tokens_per_minute=1000)
    lim.settle(lim.admit(TEAM, 100, 0.0), 100, 0.0)
    exc = refusal(lim, reserve=5000)
    assert exc.reason == "tokens"
    assert exc.retry_after_seconds == pytest.approx(6.0)


def test_concurrency_limit_refuses_while_n_are_in_flight():
    """With N requests admitted and unsettled, the next is refused for concurrency."""
    lim = limiter(max_concurrent=2)
    lim.admit(TEAM, 0, 0.0)
    lim.admit(TEAM, 0, 0.0)
    exc = refusal(lim)
    assert (exc.reason, exc.retry_after_seconds) == ("concurrency", 1.0)


def test_concurrency_limit_admits_again_after_a_settle():
    """Settling one in-flight request frees its slot at once."""
    lim = limiter(max_concurrent=2)
    first = lim.admit(TEAM, 0, 0.0)
    lim.admit(TEAM, 0, 0.0)
    lim.settle(first, 0, 0.0)
    assert lim.admit(TEAM, 0, 0.0).team == TEAM


def test_refused_request_uses_nothing():
    """A request refused by one limit takes nothing from the others."""
    lim = limiter(requests_per_minute=60, tokens_per_minute=100, max_concurrent=5)
    lim.admit(TEAM, 100, 0.0)
    refusal(lim, reserve=50)
    headers = dict(lim.admit(TEAM, 0, 0.0).headers)
    assert (headers["x-ratelimit-remaining-requests"], lim.in_flight(TEAM)) == ("58", 2)


def test_settling_twice_is_a_no_op():
    """A second settle neither frees another slot nor returns tokens again."""
    lim = limiter(tokens_per_minute=1000, max_concurrent=2)
    lim.admit(TEAM, 0, 0.0)
    admission = lim.admit(TEAM, 600, 0.0)
    lim.settle(admission, 100, 0.0)
    lim.settle(admission, 100, 0.0)
    assert (lim.in_flight(TEAM), remaining_tokens(lim)) == (1, 900)


def test_configure_keeps_in_flight_counts():
    """New limits apply to requests already in flight."""
    lim = limiter(max_concurrent=1)
    lim.admit(TEAM, 0, 0.0)
    lim.configure({TEAM: TeamLimits(max_concurrent=2)}, now=0.0)
    lim.admit(TEAM, 0, 0.0)
    assert (lim.in_flight(TEAM), refusal(lim).reason) == (2, "concurrency")


def test_configure_keeps_bucket_levels():
    """Reapplying the same limits does not refill a bucket that was emptied."""
    lim = limiter(requests_per_minute=2)
    lim.admit(TEAM, 0, 0.0)
    lim.admit(TEAM, 0, 0.0)
    lim.configure({TEAM: TeamLimits(requests_per_minute=2)}, now=0.0)
    assert refusal(lim).reason == "requests"


def test_settle_after_the_team_was_removed_is_harmless():
    """An admission outliving its team's configuration settles without error."""
    lim = limiter(max_concurrent=1)
    admission = lim.admit(TEAM, 0, 0.0)
    lim.configure({}, now=0.0)
    lim.settle(admission, 10, 1.0)
    assert lim.in_flight(TEAM) == 0


def test_unlimited_team_is_always_admitted():
    """A team with no limits is admitted however much it asks for."""
    lim = limiter()
    admissions = [lim.admit(TEAM, 10**9, 0.0) for _ in range(1000)]
    assert lim.in_flight(TEAM) == len(admissions)


@pytest.mark.parametrize(
    ("limits", "headers"),
    [
        (
            {"requests_per_minute": 60, "tokens_per_minute": 1000},
            {
                "x-ratelimit-limit-requests": "60",
                "x-ratelimit-remaining-requests": "59",
                "x-ratelimit-reset-requests": "1.000s",
                "x-ratelimit-limit-tokens": "1000",
                "x-ratelimit-remaining-tokens": "900",
                "x-ratelimit-reset-tokens": "6.000s",
            },
        ),
        (
            {"requests_per_minute": 60},
            {
                "x-ratelimit-limit-requests": "60",
                "x-ratelimit-remaining-requests": "59",
                "x-ratelimit-reset-requests": "1.000s",
            },
        ),
        (
            {"tokens_per_minute": 1000, "max_concurrent": 4},
            {
                "x-ratelimit-limit-tokens": "1000",
                "x-ratelimit-remaining-tokens": "900",
                "x-ratelimit-reset-tokens": "6.000s",
            },
        ),
        ({"max_concurrent": 4}, {}),
        ({}, {}),
    ],
    ids=["requests-and-tokens", "requests", "tokens", "concurrency-only", "unlimited"],
)
def test_ratelimit_headers_describe_the_limits_the_team_has(limits, headers):
    """An admission carries limit, remaining and reset for each bucket of the team, and no others."""
    assert dict(limiter(**limits).admit(TEAM, 100, 0.0).headers) == headers


def test_refusal_carries_ratelimit_headers():
    """A refused request is told the state of the bucket that refused it."""
    lim = limiter(requests_per_minute=1)
    lim.admit(TEAM, 0, 0.0)
    assert dict(refusal(lim).headers) == {
        "x-ratelimit-limit-requests": "1",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "60.000s",
    }


@pytest.mark.parametrize(
    ("reason", "message"),
    [
        ("requests", "Rate limit reached for requests per minute. Please try again in 2.5s."),
        ("tokens", "Rate limit reached for tokens per minute. Please try again in 2.5s."),
        ("concurrency", "Rate limit reached for concurrent requests. Please try again in 2.5s."),
    ],
)
def test_refusal_message_names_the_limit_and_the_wait(reason, message):
    """The error message says which limit was hit and how long to wait."""
    assert str(LimitExceeded(reason, 2.5)) == message


def test_refusal_survives_a_context_manager():
    """LimitExceeded passes through a ``@contextmanager`` as itself, not as a dataclass error."""

    @contextlib.contextmanager
    def passing() -> Iterator[None]:
        yield

    lim = limiter(max_concurrent=1)
    lim.admit(TEAM, 0, 0.0)
    with pytest.raises(LimitExceeded), passing():
        lim.admit(TEAM, 0, 0.0)


def test_admission_starts_unsettled():
    """A fresh admission records its team and reservation and is not yet settled."""
    admission = limiter().admit(TEAM, 42, 0.0)
    assert admission == Admission(TEAM, 42, (), settled=False)


def test_refund_gives_back_the_request_the_reservation_and_the_slot():
    """A refunded admission (its request refused after admission) leaves the team as before it."""
    lim = limiter(requests_per_minute=60, tokens_per_minute=1000, max_concurrent=1)
    lim.refund(lim.admit(TEAM, 300, 0.0), 0.0)
    headers = dict(lim.admit(TEAM, 300, 0.0).headers)
    assert (headers["x-ratelimit-remaining-requests"], headers["x-ratelimit-remaining-tokens"]) == (
        "59",
        "700",
    )
    assert lim.in_flight(TEAM) == 1


def test_refund_is_once_and_not_after_a_settle():
    """A second refund, or a refund after the settle, gives nothing more back."""
    lim = limiter(requests_per_minute=60, tokens_per_minute=1000)
    settled = lim.admit(TEAM, 300, 0.0)
    lim.settle(settled, 100, 0.0)
    lim.refund(settled, 0.0)
    refunded = lim.admit(TEAM, 300, 0.0)
    lim.refund(refunded, 0.0)
    lim.refund(refunded, 0.0)
    headers = dict(lim.admit(TEAM, 0, 0.0).headers)
    assert (headers["x-ratelimit-remaining-requests"], headers["x-ratelimit-remaining-tokens"]) == (
        "58",
        "900",
    )


def test_refund_never_fills_a_bucket_past_its_capacity():
    """Refill meanwhile and the refund together stop at the limit."""
    lim = limiter(requests_per_minute=60, tokens_per_minute=1000)
    admission = lim.admit(TEAM, 300, 0.0)
    lim.refund(admission, 120.0)
    headers = dict(lim.admit(TEAM, 0, 120.0).headers)
    assert (headers["x-ratelimit-remaining-requests"], headers["x-ratelimit-remaining-tokens"]) == (
        "59",
        "1000",
    )
