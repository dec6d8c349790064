"""Requests to a scorer served elsewhere (a grpo.rewards entry with a `kind`): JSON POSTs in parallel up to a
concurrency limit, each with a timeout, retried with doubling back-off on what passes (connection refused,
reset or broken mid-answer, a timeout, HTTP 408, 429 and 5xx; a 429's Retry-After is honoured), and counted: requests, retries, failures,
parse failures, dropped groups and latency percentiles (`SourceStats`). What could not be scored comes back as
`Unscored` with its reason; the source's failure policy decides what it becomes (`rlhf_core/rewards/remote_scorers.py`).

Credentials come from environment variables the config names (`credential_headers`); their values are sent and
never kept anywhere else: no error, metric or log line carries a header."""

from __future__ import annotations

import http.client
import json
import math
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from rlhf_core.config.errors import UserError
from rlhf_core.config.redaction import redact

TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
MAX_RETRY_AFTER_S = 60.0  # a server's Retry-After is honoured up to this
SNIPPET_CHARS = 200


class RemoteRewardError(UserError):
    """A served reward source that cannot score (its failure policy is fail), or that is set up wrong; the
    message is one sentence naming the source."""


@dataclass(frozen=True)
class Unscored:
    """A completion its source could not score, and why (one phrase)."""

    reason: str
    parse_failure: bool = False


class RequestFailed(Exception):
    """One attempt that failed; `transient` ones are retried."""

    def __init__(self, reason: str, *, transient: bool, retry_after: float | None = None):
        super().__init__(reason)
        self.reason, self.transient, self.retry_after = reason, transient, retry_after


@dataclass(frozen=True)
class RequestPolicy:
    timeout_s: float = 30.0
    max_retries: int = 3
    backoff_s: float = 1.0
    max_concurrency: int = 8

    def wait_s(self, retry: int, retry_after: float | None) -> float:
        """Seconds before retry number `retry` (1, 2, ...): backoff_s doubled each time, or Retry-After when longer."""
        wait = self.backoff_s * 2 ** (retry - 1)
        return max(wait, min(retry_after, MAX_RETRY_AFTER_S)) if retry_after is not None else wait


def credential_headers(api_key_env: str | None, headers_env: dict[str, str], *, field: str) -> dict[str, str]:
    """The request headers whose values the named environment variables hold; a variable that is not set is
    refused in one sentence naming it (never its value)."""
    wanted = dict(headers_env)
    if api_key_env is not None:
        wanted["Authorization"] = api_key_env
    headers = {}
    for header, name in wanted.items():
        value = os.environ.get(name)
        if not value:
            raise RemoteRewardError(f"{field}: environment variable {name} (for the {header} header) is not set")
        headers[header] = f"Bearer {value}" if header == "Authorization" and name == api_key_env else value
    return headers


def post_json(url: str, body: dict, headers: dict[str, str], timeout_s: float):
    """POST `body` as JSON and return the decoded answer, or raise RequestFailed saying what happened."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read()
    except urllib.error.HTTPError as err:
        snippet = redact(err.read().decode(errors="replace")[:SNIPPET_CHARS].strip())
        retry_after = _seconds(err.headers.get("Retry-After")) if err.headers else None
        raise RequestFailed(
            f"HTTP {err.code}: {snippet}", transient=err.code in TRANSIENT_STATUS, retry_after=retry_after
        ) from None
    except TimeoutError:
        raise RequestFailed(f"no answer within {timeout_s:g} s", transient=True) from None
    except http.client.HTTPException as err:  # the server went away mid-answer (IncompleteRead, BadStatusLine)
        raise RequestFailed(f"the connection broke mid-answer ({type(err).__name__})", transient=True) from None
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        if isinstance(reason, TimeoutError):
            raise RequestFailed(f"no answer within {timeout_s:g} s", transient=True) from None
        raise RequestFailed(f"connection failed: {reason}", transient=True) from None
    try:
        return json.loads(raw)
    except ValueError:
        snippet = redact(raw.decode(errors="replace")[:SNIPPET_CHARS].strip())
        raise RequestFailed(f"the answer is not JSON: {snippet!r}", transient=False) from None


def _seconds(value: str | None) -> float | None:
    try:
        seconds = float(value) if value is not None else None
    except ValueError:  # an HTTP date: the doubling back-off stands
        return None
    return seconds if seconds is not None and math.isfinite(seconds) and seconds >= 0 else None


@dataclass
class SourceStats:
    """One source's counts since the last `pop`, shared by its request threads."""

    name: str
    latencies: list[float] = field(default_factory=list)
    counts: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("requests", "retries", "failures", "parse_failures", "dropped_groups"), 0
        )
    )
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **counts: int) -> None:
        with self.lock:
            for key, n in counts.items():
                self.counts[key] += n

    def timed(self, seconds: float) -> None:
        with self.lock:
            self.latencies.append(seconds)

    def pop(self) -> dict[str, float]:
        """rewards/<name>/latency_p50_s, latency_p95_s (successful requests), requests, retries, failures,
        parse_failures, dropped_groups since the last pop; the counts start again from 0."""
        with self.lock:
            latencies, counts = sorted(self.latencies), dict(self.counts)
            self.latencies.clear()
            self.counts = dict.fromkeys(counts, 0)
        prefix = f"rewards/{self.name}/"
        metrics = {prefix + key: float(n) for key, n in counts.items()}
        if latencies:
            metrics[prefix + "latency_p50_s"] = percentile(latencies, 50)
            metrics[prefix + "latency_p95_s"] = percentile(latencies, 95)
        return metrics


def percentile(ordered: Sequence[float], q: float) -> float:
    """The q-th percentile of sorted values, linearly interpolated (numpy's default)."""
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class RemoteCaller:
    """POSTs to one endpoint under a `RequestPolicy`; `call_all` runs them in parallel and returns each answer,
    or an `Unscored` saying why it has none once its retries are spent."""

    def __init__(self, url: str, policy: RequestPolicy, headers: dict[str, str], stats: SourceStats, post=post_json):
        self.url, self.policy, self.headers, self.stats, self._post = url, policy, headers, stats, post

    def call(self, body: dict):
        """One request with its retries: the answer, or Unscored."""
        for attempt in range(self.policy.max_retries + 1):
            if attempt:
                self.stats.add(retries=1)
            self.stats.add(requests=1)
            started = time.monotonic()
            try:
                answer = self._post(self.url, body, self.headers, self.policy.timeout_s)
            except RequestFailed as failed:
                if not failed.transient or attempt == self.policy.max_retries:
                    tries = f"after {attempt + 1} attempts" if attempt else "on the first attempt"
                    return Unscored(f"{failed.reason} ({tries})")
                time.sleep(self.policy.wait_s(attempt + 1, failed.retry_after))
                continue
            self.stats.timed(time.monotonic() - started)
            return answer
        raise AssertionError("unreachable")

    def call_all(self, bodies: Sequence[dict], read: Callable[[object], object]) -> list:
        """Each body's answer passed through `read` (which raises ValueError for an answer without a score),
        or Unscored; in the bodies' order, at most max_concurrency in flight."""

        def one(body: dict):
            answer = self.call(body)
            if isinstance(answer, Unscored):
                return answer
            try:
                return read(answer)
            except (ValueError, KeyError, IndexError, TypeError) as err:
                return Unscored(f"the answer holds no score: {err}", parse_failure=True)

        if len(bodies) <= 1 or self.policy.max_concurrency == 1:
            return [one(body) for body in bodies]
        with ThreadPoolExecutor(min(self.policy.max_concurrency, len(bodies)), thread_name_prefix="reward") as pool:
            return list(pool.map(one, bodies))
