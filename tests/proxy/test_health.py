"""The backend health rule of :mod:`flowlift.proxy.dispatch.upstream.health`, on an injected clock:
what counts as evidence against a backend, distinct requests in a row, probes."""

from __future__ import annotations

from flowlift.proxy.dispatch.upstream.health import Health


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_request_evidence_never_cools_however_many_requests_give_it():
    clock = Clock()
    h = Health(failures_to_cool=2, cooldown_s=30, clock=clock)
    for request in range(20):
        h.call(request).failed("request")  # first-token timeouts after headers, stalls
    assert h.available(clock.t) and h.consecutive_failures == 0


def test_attempts_of_one_request_count_once():
    clock = Clock()
    h = Health(failures_to_cool=3, cooldown_s=30, clock=clock)
    for _ in range(5):
        h.call(7).failed("down")
    assert h.available(clock.t) and h.consecutive_failures == 1


def test_a_silent_timeout_counts_only_when_the_backend_answered_nobody_meanwhile():
    clock = Clock()
    h = Health(failures_to_cool=1, cooldown_s=30, clock=clock)
    stalled = h.call(1)
    clock.t += 1
    other = h.call(2)
    other.answered(200)  # the backend answers another request while 1 waits
    other.succeeded()
    clock.t += 1
    stalled.failed("silent")
    assert h.available(clock.t)
    hole = h.call(3)  # nothing answered after this one was sent: a black hole
    clock.t += 1
    hole.failed("silent")
    assert not h.available(clock.t)


def test_a_5xx_answer_does_not_show_the_backend_alive():
    clock = Clock()
    h = Health(failures_to_cool=1, cooldown_s=30, clock=clock)
    stalled = h.call(1)
    clock.t += 1
    h.call(2).answered(503)
    stalled.failed("silent")
    assert not h.available(clock.t)


def test_failures_further_apart_than_the_window_start_a_new_row():
    clock = Clock()
    h = Health(failures_to_cool=2, cooldown_s=30, window_s=10, clock=clock)
    h.call(1).failed("down")
    clock.t += 11
    h.call(2).failed("down")
    assert h.available(clock.t) and h.consecutive_failures == 1
    h.call(3).failed("down")
    assert not h.available(clock.t)


def test_after_the_cool_down_one_probe_goes_through_and_its_success_reopens():
    clock = Clock()
    h = Health(failures_to_cool=1, cooldown_s=30, clock=clock)
    h.call(1).failed("down")
    assert not h.available(clock.t + 29.9) and h.wait_s(clock.t) == 30
    clock.t += 30
    assert h.available(clock.t)
    probe = h.call(2)
    assert probe.probe and not h.available(clock.t)  # the others wait for the probe
    assert h.wait_s(clock.t) == 1.0
    probe.answered(200)
    probe.succeeded()
    probe.close()
    assert h.available(clock.t) and not h.half_open
    assert not h.call(3).probe


def test_a_failed_probe_cools_again_at_once_and_a_probe_without_a_verdict_frees_the_next():
    clock = Clock()
    h = Health(failures_to_cool=3, cooldown_s=30, clock=clock)
    for request in range(3):
        h.call(request).failed("down")
    clock.t += 30
    probe = h.call(10)
    probe.failed("down")  # one piece of evidence is enough while half-open
    probe.close()
    assert not h.available(clock.t + 29)
    clock.t += 30
    undecided = h.call(11)
    undecided.failed("request")  # its own stall says nothing about the backend
    undecided.close()
    assert h.available(clock.t) and h.call(12).probe


def test_a_probe_cancelled_before_its_answer_lets_the_next_request_probe():
    clock = Clock()
    h = Health(failures_to_cool=1, cooldown_s=5, clock=clock)
    first = h.call(1)
    first.failed("down")
    first.close()
    clock.t += 5
    probe = h.call(2)
    assert probe.probe and not h.available(clock.t)
    probe.close()  # cancelled: counted out without an outcome
    assert h.available(clock.t) and h.in_flight == 0 and h.call(3).probe


def test_a_429_without_retry_after_cools_nothing_and_with_it_cools_that_long():
    clock = Clock(0.0)
    h = Health(failures_to_cool=1, cooldown_s=30, clock=clock)
    h.call(1).failed("busy")
    assert h.available(0.0)
    h.call(2).failed("busy", retry_after_s=4)
    assert not h.available(3.9) and h.available(4.0)
