"""rlhf_core/rewards/remote.py: requests to a served scorer, against a real loopback server (tests/fixtures/
scorers.py): retries with back-off on what passes (429, 5xx, refused connections, timeouts), none on what does
not, Retry-After, the concurrency limit, the counts and latency percentiles, credentials from the environment."""

import socket
import threading
import time

import pytest

from rlhf_core.rewards.remote import (
    RemoteCaller,
    RemoteRewardError,
    RequestFailed,
    RequestPolicy,
    SourceStats,
    Unscored,
    credential_headers,
    percentile,
    post_json,
)
from tests.fixtures.scorers import Behaviour, scorer_in_thread

FAST = RequestPolicy(timeout_s=5.0, max_retries=3, backoff_s=0.01, max_concurrency=4)


def caller(url, policy=FAST, headers=None):
    return RemoteCaller(url + "/score", policy, headers or {}, SourceStats("s"))


def test_a_429_storm_is_retried_until_it_passes_and_counted():
    with scorer_in_thread(Behaviour(mode="429x3")) as (url, behaviour):
        c = caller(url)
        assert c.call({"prompt": "p", "completion": "good"}) == {"result": {"score": pytest.approx(0.4404, abs=1e-4)}}
    assert behaviour.count == 4
    metrics = c.stats.pop()
    assert (metrics["rewards/s/requests"], metrics["rewards/s/retries"]) == (4.0, 3.0)
    assert c.stats.pop()["rewards/s/requests"] == 0.0  # counts start again after a pop


def test_retries_run_out_into_unscored_with_the_reason_and_a_doubling_wait():
    with scorer_in_thread(Behaviour(mode="500")) as (url, behaviour):
        started = time.monotonic()
        out = caller(url, RequestPolicy(5.0, max_retries=2, backoff_s=0.1)).call({"completion": "x"})
        waited = time.monotonic() - started
    assert isinstance(out, Unscored) and out.reason.startswith("HTTP 500") and "after 3 attempts" in out.reason
    assert behaviour.count == 3 and waited >= 0.3  # 0.1 then 0.2
    assert RequestPolicy(backoff_s=1.0).wait_s(3, None) == 4.0
    assert RequestPolicy(backoff_s=1.0).wait_s(1, 7.0) == 7.0 and RequestPolicy(backoff_s=1.0).wait_s(1, 1e9) == 60.0


@pytest.mark.parametrize(
    ("mode", "reason", "attempts"),
    [("garbage", "the answer is not JSON: '<html>not json</html>'", 1), ("slow", "no answer within 0.3 s", 2)],
)
def test_garbage_is_not_retried_and_a_slow_scorer_times_out(mode, reason, attempts):
    with scorer_in_thread(Behaviour(mode=mode, delay_s=1.0)) as (url, behaviour):
        out = caller(url, RequestPolicy(timeout_s=0.3, max_retries=1, backoff_s=0.01)).call({"completion": "x"})
    assert isinstance(out, Unscored) and out.reason.startswith(reason)
    assert behaviour.count == attempts


def test_a_refused_connection_is_transient():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once closed
    with pytest.raises(RequestFailed, match="connection failed") as failed:
        post_json(f"http://127.0.0.1:{port}/x", {}, {}, 1.0)
    assert failed.value.transient


def test_a_server_that_dies_mid_answer_is_transient():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()

        def half_answer():
            connection, _ = server.accept()
            connection.recv(65536)
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 84\r\n\r\n{")
            connection.close()

        threading.Thread(target=half_answer, daemon=True).start()
        with pytest.raises(RequestFailed, match=r"broke mid-answer \(IncompleteRead\)") as failed:
            post_json(f"http://127.0.0.1:{server.getsockname()[1]}/x", {}, {}, 5.0)
    assert failed.value.transient


def test_call_all_keeps_order_honours_the_concurrency_limit_and_turns_bad_answers_into_parse_failures():
    in_flight, most = 0, 0
    lock = threading.Lock()

    def post(url, body, headers, timeout_s):
        nonlocal in_flight, most
        with lock:
            in_flight += 1
            most = max(most, in_flight)
        time.sleep(0.02)
        with lock:
            in_flight -= 1
        return {"v": body["i"]} if body["i"] != 3 else {"nothing": 1}

    c = RemoteCaller("http://x", RequestPolicy(max_concurrency=3), {}, SourceStats("s"), post=post)
    out = c.call_all([{"i": i} for i in range(10)], lambda a: float(a["v"]))
    assert out[:3] == [0.0, 1.0, 2.0] and out[4:] == [float(i) for i in range(4, 10)]
    assert isinstance(out[3], Unscored) and out[3].parse_failure and "'v'" in out[3].reason
    assert most == 3


def test_percentiles_interpolate_as_numpy():
    import numpy as np

    values = sorted([0.5, 0.1, 0.9, 0.3, 0.7, 0.2])
    for q in (0, 50, 95, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_credentials_come_from_the_named_variables_and_a_missing_one_is_named_not_shown(monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "sk-secret-123")
    monkeypatch.setenv("TEAM_KEY", "team-456")
    headers = credential_headers("JUDGE_KEY", {"X-Api-Key": "TEAM_KEY"}, field="grpo.rewards[0]")
    assert headers == {"Authorization": "Bearer sk-secret-123", "X-Api-Key": "team-456"}
    monkeypatch.delenv("JUDGE_KEY")
    with pytest.raises(RemoteRewardError, match=r"grpo.rewards\[0\]: environment variable JUDGE_KEY .* is not set"):
        credential_headers("JUDGE_KEY", {}, field="grpo.rewards[0]")
    with scorer_in_thread(Behaviour(token="sk-secret-123")) as (url, behaviour):
        refused = caller(url, headers={"Authorization": "Bearer wrong"}).call({"completion": "x"})
        ok = caller(url, headers={"Authorization": "Bearer sk-secret-123"}).call({"completion": "x"})
    assert isinstance(refused, Unscored) and "HTTP 401" in refused.reason and "secret" not in refused.reason
    assert ok == {"result": {"score": 0.0}}
