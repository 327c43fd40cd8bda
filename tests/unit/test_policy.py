"""Restart policy: pure decisions from a server's run history (no processes, no mocks)."""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from clonemap.supervisor.policy import (DEFAULT_POLICY, GiveUp, Leave, PolicyConfig, Restart, Run,
                               Running, backoff_s, decide, describe_exit)

CFG = PolicyConfig(backoff_initial_s=0.5, backoff_factor=2.0, backoff_cap_s=8.0,
                   crash_limit=5, crash_window_s=60.0, stable_after_s=10.0)


def crash_loop(n: int, start: float = 0.0, run_s: float = 1.0, code: int = 1,
               cfg: PolicyConfig = CFG) -> list[Run]:
    """``n`` short runs, each restarted exactly when the policy said."""
    history: list[Run] = []
    t = start
    for i in range(n):
        history.append(Run(t, t + run_s, code, manual=(i == 0)))
        t += run_s
        action = decide(history, t, cfg)
        if isinstance(action, Restart):
            t += action.delay_s
    return history


def test_nothing_yet_means_start_now():
    assert decide([], 0.0, CFG) == Restart(0.0, 0, "not started yet")


def test_running_means_nothing_to_do():
    assert decide([Run(0.0, manual=True)], 100.0, CFG) == Running()


def test_stopped_on_request_is_left_alone_whatever_the_exit():
    for code in (0, 1, -9, None):
        action = decide([Run(0.0, 5.0, code, stop_requested=True)], 6.0, CFG)
        assert isinstance(action, Leave) and "stopped on request" in action.reason


def test_first_crash_restarts_after_the_initial_backoff():
    action = decide([Run(0.0, 3.0, 1, manual=True)], 3.0, CFG)
    assert action == Restart(0.5, 1, "exited with code 1; restart 1 in a row")


def test_an_unrequested_exit_0_is_a_crash_too():
    action = decide([Run(0.0, 3.0, 0, manual=True)], 3.0, CFG)
    assert isinstance(action, Restart) and action.attempt == 1


def test_sigkill_drill_is_restarted():
    action = decide([Run(0.0, 3.0, -9, manual=True)], 3.0, CFG)
    assert isinstance(action, Restart)
    assert action.reason.startswith("killed by SIGKILL")


def test_backoff_grows_exponentially_to_the_cap():
    assert [backoff_s(k, CFG) for k in range(0, 8)] == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert backoff_s(10**6, CFG) == 8.0          # no overflow for absurd streaks


def test_delays_along_a_crash_streak():
    loose = PolicyConfig(backoff_initial_s=0.5, backoff_factor=2.0, backoff_cap_s=8.0,
                         crash_limit=100, crash_window_s=60.0, stable_after_s=10.0)
    history: list[Run] = []
    delays = []
    t = 0.0
    for i in range(7):
        history.append(Run(t, t + 1.0, 1, manual=(i == 0)))
        t += 1.0
        action = decide(history, t, loose)
        delays.append(action.delay_s)
        t += action.delay_s
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_delay_counts_from_the_exit_not_from_the_question():
    history = [Run(0.0, 10.0, 1, manual=True), Run(10.5, 11.0, 1)]
    assert decide(history, 11.0, CFG).delay_s == 1.0
    assert decide(history, 11.4, CFG).delay_s == pytest.approx(0.6)
    assert decide(history, 50.0, CFG).delay_s == 0.0


def test_a_long_healthy_run_resets_the_backoff():
    history = [Run(0.0, 1.0, 1, manual=True), Run(1.5, 2.5, 1), Run(3.5, 4.5, 1),
               Run(6.5, 100.0, 1)]                  # the last one ran 93.5 s
    action = decide(history, 100.0, CFG)
    assert action.attempt == 1 and action.delay_s == 0.5


def test_crash_loop_gives_up_at_the_limit():
    history = crash_loop(5)
    action = decide(history, history[-1].exited_at, CFG)
    assert isinstance(action, GiveUp)
    assert action.reason.startswith("crashed 5 times in 60 s")
    assert isinstance(decide(crash_loop(4), crash_loop(4)[-1].exited_at, CFG), Restart)


def test_give_up_is_sticky():
    history = crash_loop(5)
    assert isinstance(decide(history, 10_000.0, CFG), GiveUp)   # waiting changes nothing


def test_crashes_spread_beyond_the_window_are_restarted_forever():
    history: list[Run] = []
    t = 0.0
    for i in range(50):                              # one 5 s crash every ~20 s
        history.append(Run(t, t + 5.0, 1, manual=(i == 0)))
        t += 5.0
        action = decide(history, t, CFG)
        assert isinstance(action, Restart), (i, action)
        t += action.delay_s + 15.0


def test_operator_restart_begins_a_fresh_count():
    history = crash_loop(5)
    assert isinstance(decide(history, 100.0, CFG), GiveUp)
    t = history[-1].exited_at + 5
    history.append(Run(t, t + 1.0, 1, manual=True))  # `supervisor restart s0/primary`
    action = decide(history, t + 1.0, CFG)
    assert isinstance(action, Restart) and action.attempt == 1 and action.delay_s == 0.5


def test_requested_stop_in_the_middle_breaks_the_streak():
    history = [Run(0.0, 1.0, 1, manual=True), Run(1.5, 2.5, 1),
               Run(3.5, 4.0, 0, stop_requested=True), Run(5.0, 6.0, 1)]
    action = decide(history, 6.0, CFG)
    assert action.attempt == 1 and action.delay_s == 0.5


def test_config_and_usage_errors_give_up_at_once():
    action = decide([Run(0.0, 0.2, 2, manual=True)], 0.2, CFG)
    assert isinstance(action, GiveUp)
    assert "usage or configuration error" in action.reason and "code 2" in action.reason


def test_an_exit_code_outside_the_table_is_a_crash_and_restarted():
    assert isinstance(decide([Run(0.0, 0.2, 64, manual=True)], 0.2, CFG), Restart)


def test_port_in_use_is_retried():
    assert isinstance(decide([Run(0.0, 0.2, 3, manual=True)], 0.2, CFG), Restart)


@pytest.mark.parametrize("run, text", [
    (Run(0.0), "running"),
    (Run(0.0, 1.0, None), "exited"),
    (Run(0.0, 1.0, 1), "exited with code 1"),
    (Run(0.0, 1.0, -15), "killed by SIGTERM"),
    (Run(0.0, 1.0, -200), "killed by signal 200"),
])
def test_describe_exit(run, text):
    assert describe_exit(run) == text


@pytest.mark.parametrize("kwargs, text", [
    ({"backoff_initial_s": -1}, "backoff_initial_s"),
    ({"backoff_factor": 0.5}, "backoff_factor"),
    ({"backoff_cap_s": 0.1}, "backoff_cap_s"),
    ({"crash_limit": 0}, "crash_limit"),
    ({"crash_window_s": 0}, "crash_window_s"),
    ({"stable_after_s": 0}, "stable_after_s"),
])
def test_bad_config_is_refused(kwargs, text):
    with pytest.raises(ValueError) as info:
        PolicyConfig(**kwargs)
    assert text in str(info.value)


runs = st.lists(st.tuples(st.floats(0, 30), st.floats(0, 30), st.integers(-15, 70),
                          st.booleans(), st.booleans()), min_size=1, max_size=30)


@given(runs, st.floats(0, 100))
def test_properties(spec, extra_s):
    """Any history: delays within [0, cap]; never restart a stopped server; the answer is
    a function of the arguments only."""
    history, t = [], 0.0
    for gap, length, code, stopped, manual in spec:
        t += gap
        history.append(Run(t, t + length, code, stop_requested=stopped, manual=manual))
        t += length
    now = t + extra_s
    action = decide(history, now, DEFAULT_POLICY)
    assert action == decide(list(history), now, DEFAULT_POLICY)
    if history[-1].stop_requested:
        assert isinstance(action, Leave)
    elif isinstance(action, Restart):
        assert 0.0 <= action.delay_s <= DEFAULT_POLICY.backoff_cap_s
        assert action.attempt >= 1
    else:
        assert isinstance(action, GiveUp)
