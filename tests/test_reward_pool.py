"""Reward workers and the HTTP verifier (issue 46, part 2): guarded reward-function calls.

- The pool (reward_workers, ppo_ray.driver.reward_pool.RewardWorkerPool) on the real reward actor
  (RewardHost) and real worker actors: a function that sleeps past reward_timeout_s, one that
  raises and one that returns NaN for one row, each its own case: every other row keeps its
  exact score, the bad row gets the policy, the counts say what happened; the worker killed
  for a timeout is replaced and the next call works.
- The bisection's bound (reward_retry_calls), without Ray.
- The HTTP verifier against a server on 127.0.0.1 that the test starts: batching, a 500 then
  success, a hang past the limit, malformed replies, a refused connection.

Scores here are small integers (the row number of "r<i>") times weight 1.0 plus 0.0: exact in
float32 by construction, so they are compared exactly (no rounding is involved).
"""

from __future__ import annotations

import http.server
import json
import math
import socket
import threading
import time

import pytest

from helpers import tiny_test_config
from ppo_ray.rewards import HttpVerifier, RewardError
from reward_fns import row_number

TIMEOUT_S = 3.0  # the pool tests' reward_timeout_s: far above a trivial call, even on a busy machine
B = 8            # rows per batch; chunks of 2 over 2 workers


def texts_batch(responses: list[str], eos_rows: tuple[int, ...] = ()):
    """Rows of 3 response tokens, cut off (no EOS) but the rows of `eos_rows`, which end with EOS."""
    import torch

    from ppo_ray.batch import RolloutBatch

    n = len(responses)
    response_ids = torch.full((n, 3), 6)
    response_ids[list(eos_rows), -1] = 1  # EOS
    return RolloutBatch(
        prompt_ids=torch.full((n, 2), 5), prompt_mask=torch.ones(n, 2, dtype=torch.bool),
        response_ids=response_ids, response_mask=torch.ones(n, 3, dtype=torch.bool),
        gen_logprobs=torch.zeros(n, 3), adapter_version=0, pad_token_id=0, eos_token_id=1,
        prompts=[f"p{i}" for i in range(n)], responses=list(responses))


ROWS = [f"r{i}" for i in range(B)]  # row 3 is the bad one


# ----------------------------------------------------------------------------- the pool, on Ray
@pytest.fixture(scope="module")
def reward_host(ray_session):
    """make(fn, policy): a real reward actor with 2 reward workers over `fn`, killed at the end.
    The workers reserve no CPU (reward_worker_num_cpus 0): the module's hosts live until its end,
    and in the full suite the session's Ray cluster has other tests' actors on its 2 CPUs (with
    0.5 each the fourth host's workers waited past placement_timeout_s)."""
    from ppo_ray.driver.hosts import RewardHost

    made = []

    def make(fn: str, policy: str):
        cfg = tiny_test_config(reward_funcs=[fn], reward_weights=[], reward_workers=2, reward_chunk_size=2, reward_timeout_s=TIMEOUT_S,
                               reward_failure=policy, reward_failure_score=-1.5, nonfinite_reward="drop",
                               reward_worker_num_cpus=0)
        actor = ray_session.remote(RewardHost).options(max_concurrency=1).remote(cfg.slice("reward"), None)
        made.append(actor)
        return actor

    yield make
    for actor in made:
        ray_session.kill(actor)


def score(ray, host, responses, eos_rows=(), columns=None, batch=None):
    scores, stats = host.score.remote(batch or texts_batch(responses, eos_rows), columns=columns)
    return ray.get(scores), ray.get(stats)


def id_batch(groups: list[int]):
    """texts_batch of len(groups) rows with these group ids, each prompt "#<100 + its group> ..."
    (reward_fns.row_id's mark) and the rows' responses "r<i>"."""
    import dataclasses

    import torch

    batch = texts_batch([f"r{i}" for i in range(len(groups))])
    return dataclasses.replace(batch, groups=torch.tensor(groups), prompts=[f"#{100 + g} p" for g in groups])


# case: (function, policy, row 3's score, the failure counts)
# chunks of 2 rows: [2, 3] fails, then its halves [2] (fine) and [3] (fails again): 2 failed calls, 2 extra
CASES = {
    "sleeps": ("reward_fns:sleeps_on_r3", "drop", math.nan,
               dict(timeouts=2, exceptions=0, nonfinite=0, rows_dropped=1, rows_fixed_score=0, retry_calls=2)),
    "raises": ("reward_fns:raises_on_r3", "score", -1.5,
               dict(timeouts=0, exceptions=2, nonfinite=0, rows_dropped=0, rows_fixed_score=1, retry_calls=2)),
    "nan": ("reward_fns:nan_on_r3", "drop", math.nan,
            dict(timeouts=0, exceptions=0, nonfinite=1, rows_dropped=0, rows_fixed_score=0, retry_calls=0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pool_keeps_every_good_row_and_counts_the_bad_one(ray_session, reward_host, case):
    fn, policy, bad_score, counts = CASES[case]
    host = reward_host(fn, policy)
    before = ray_session.get(host.reward_workers.remote())
    scores, stats = score(ray_session, host, ROWS)
    want = [row_number(r) for r in ROWS]
    assert [s for i, s in enumerate(scores.tolist()) if i != 3] == [w for i, w in enumerate(want) if i != 3]
    assert (math.isnan(scores[3]) and math.isnan(bad_score)) or float(scores[3]) == bad_score
    assert stats.failures.parts() == {f"reward_{k}": float(v) for k, v in counts.items()}
    assert stats.dropped_nonfinite == (1.0 if math.isnan(bad_score) else 0.0)
    after = ray_session.get(host.reward_workers.remote())
    assert len(after) == 2
    # a timeout's worker is killed and replaced (twice here); nothing else replaces one
    assert len(set(after) - set(before)) == (counts["timeouts"])
    # the next call works, on the same (replaced) workers: all rows exact, nothing failed
    good = [f"r{i}" for i in range(10, 10 + B)]
    scores, stats = score(ray_session, host, good)
    assert scores.tolist() == [row_number(r) for r in good]
    assert set(stats.failures.parts().values()) == {0.0}
    assert ray_session.get(host.reward_workers.remote()) == after


def test_pool_error_policy_names_the_function_rows_and_failure(ray_session, reward_host):
    host = reward_host("reward_fns:raises_on_r3", "error")
    with pytest.raises(RewardError, match=r"reward function 'reward_fns:raises_on_r3' failed on rows 2-3 of 8: "
                                          r"raised ValueError: row r3 is bad"):
        score(ray_session, host, ROWS)


def test_pool_workers_pass_the_finish_reasons(ray_session, reward_host):
    """A function with **kwargs on the reward workers gets each of its chunk's rows' finish
    reason ("stop" on the rows that ended with EOS), in row order."""
    host = reward_host("reward_fns:numbers_plus_ten_at_eos", "error")
    scores, _ = score(ray_session, host, ROWS, eos_rows=(0, 3, 4, 7))
    assert scores.tolist() == [row_number(r) + 10.0 * (i in (0, 3, 4, 7)) for i, r in enumerate(ROWS)]


def test_pool_workers_pass_the_dataset_columns(ray_session, reward_host):
    """A function that names a dataset column, on the reward workers (chunks of 2 rows over 2
    workers): each row gets its prompt's value, by group id (two rows a prompt, out of order)."""
    from ppo_ray.data import PromptColumns

    host = reward_host("reward_fns:row_id", "error")
    groups = [3, 3, 0, 0, 2, 2, 1, 1]
    scores, stats = score(ray_session, host, None, columns=PromptColumns({"id": [100, 101, 102, 103]}),
                          batch=id_batch(groups))
    assert scores.tolist() == [100.0 + g for g in groups]
    assert set(stats.failures.parts().values()) == {0.0}


# ----------------------------------------------------------------------------- the bisection's bound
def test_retry_calls_bound_the_bisection():
    """A function that always fails, one chunk of 8 rows, 2 extra calls allowed: the chunk, then
    its two halves (the budget is spent), whose rows all get the fixed score."""
    from actors.reward import RewardScorer

    scorer = RewardScorer(None, ["reward_fns:raises"], failure="score", failure_score=-2.0, retry_calls=2)
    scores, stats = scorer.score(texts_batch(ROWS))
    assert scores.tolist() == [-2.0] * B
    assert stats.failures.exceptions == 3.0 and stats.failures.retry_calls == 2.0
    assert stats.failures.rows_fixed_score == B


def test_default_path_reports_no_failure_counts():
    """reward_workers 0, reward_failure error, no verifier: the plain call, as before (no new keys)."""
    from actors.reward import RewardScorer

    scores, stats = RewardScorer(None, ["reward_fns:numbers"]).score(texts_batch(ROWS))
    assert scores.tolist() == [row_number(r) for r in ROWS]
    assert stats.failures is None and list(stats.parts()) == ["score/reward_fns:numbers", "dropped_nonfinite"]


# ----------------------------------------------------------------------------- the HTTP verifier
class Verifier:
    """A verifier service on 127.0.0.1: scores "r<i>" as i; a request holding "hang" sleeps
    `hang_s` first, one holding "bad-count" gets one score too few, "not-json" a reply that is
    not JSON, "not-number" a string score; the first `fail_first` requests get HTTP 500.
    `sizes` records each request's row count, `bodies` each request's JSON. It reads only
    "prompts" and "responses": a service written before "columns" was sent."""

    def __init__(self):
        self.sizes: list[int] = []
        self.bodies: list[dict] = []
        self.fail_first, self.hang_s = 0, 0.0
        service = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                responses = body["responses"]
                assert len(body["prompts"]) == len(responses)
                service.sizes.append(len(responses))
                service.bodies.append(body)
                if service.fail_first > 0:
                    service.fail_first -= 1
                    return self.reply(500, b'{"error": "busy"}')
                if "hang" in responses:
                    time.sleep(service.hang_s)
                if "not-json" in responses:
                    return self.reply(200, b"<html>oops</html>")
                scores = [-1.0 if r in ("hang", "bad-count", "not-number") else row_number(r) for r in responses]
                if "bad-count" in responses:
                    scores = scores[:-1]
                if "not-number" in responses:
                    scores[0] = "high"
                self.reply(200, json.dumps({"scores": scores}).encode())

            def reply(self, code: int, data: bytes):
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout)
                    pass

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads, self.server.block_on_close = True, False  # a hanging handler never blocks close
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def verifier():
    service = Verifier()
    yield service
    service.close()


def scorer_for(url: str, **kw):
    from actors.reward import RewardScorer

    kw.setdefault("verifier_backoff_s", 0.01)
    return RewardScorer(None, [url], **kw)


def test_verifier_batches(verifier):
    scores, stats = scorer_for(verifier.url, verifier_batch_size=3).score(texts_batch(ROWS))
    assert scores.tolist() == [row_number(r) for r in ROWS]
    assert verifier.sizes == [3, 3, 2]
    assert set(stats.failures.parts().values()) == {0.0}
    verifier.sizes.clear()
    scorer_for(verifier.url, verifier_batch_size=3, verifier_concurrency=3).score(texts_batch(ROWS))
    assert sorted(verifier.sizes) == [2, 3, 3]  # the same requests, sent at once


def test_verifier_sends_the_rows_columns(verifier):
    """The request's "columns": per column (the finish reasons and the dataset's), one value per
    row of that request, in its order; this service reads only prompts and responses, as one
    written before columns were sent, and scores as before."""
    from ppo_ray.data import PromptColumns

    groups = [1, 1, 0, 0, 2, 2, 3, 3]
    batch = id_batch(groups)
    columns = PromptColumns({"answer": ["a0", "a1", "a2", "a3"], "id": [0, 1, 2, 3]})
    scores, _ = scorer_for(verifier.url, verifier_batch_size=3).score(batch, columns)
    assert scores.tolist() == [row_number(r) for r in ROWS]
    assert [b["columns"] for b in verifier.bodies] == [
        {"finish_reasons": ["length"] * n, "answer": [f"a{g}" for g in groups[s:s + n]], "id": groups[s:s + n]}
        for s, n in ((0, 3), (3, 3), (6, 2))]
    assert [b["prompts"] for b in verifier.bodies] == [batch.prompts[0:3], batch.prompts[3:6], batch.prompts[6:8]]
    verifier.bodies.clear()
    HttpVerifier(verifier.url)(["p"], ["r1"])  # called as a two-argument function: no columns
    assert verifier.bodies == [{"prompts": ["p"], "responses": ["r1"], "columns": {}}]


def test_verifier_retries_a_500(verifier):
    verifier.fail_first = 1
    scores, stats = scorer_for(verifier.url, verifier_retries=2).score(texts_batch(ROWS))
    assert scores.tolist() == [row_number(r) for r in ROWS]
    assert verifier.sizes == [B, B]  # the 500, then the retry
    assert stats.failures.exceptions == 0.0
    verifier.fail_first = 5
    with pytest.raises(RewardError, match=rf"reward verifier {verifier.url} failed after 3 attempts: HTTP 500"):
        scorer_for(verifier.url, verifier_retries=2).score(texts_batch(ROWS))


def test_verifier_hang_past_the_limit_is_a_timeout_and_only_its_row_dropped(verifier):
    verifier.hang_s = 5.0
    rows = [*ROWS[:3], "hang", *ROWS[4:]]
    scores, stats = scorer_for(verifier.url, timeout_s=0.3, verifier_batch_size=4, failure="drop",
                               nonfinite="drop").score(texts_batch(rows))
    assert math.isnan(scores[3])
    assert [s for i, s in enumerate(scores.tolist()) if i != 3] == [row_number(r) for r in rows if r != "hang"]
    # [0-3] hangs; its halves [0, 1] (fine) and [2, 3] (hangs); then [2] (fine) and [3] (hangs)
    assert stats.failures.timeouts == 3.0 and stats.failures.retry_calls == 4.0
    assert stats.failures.rows_dropped == 1.0 and stats.dropped_nonfinite == 1.0
    with pytest.raises(RewardError, match=rf"failed on rows 0-3 of 8: reward verifier {verifier.url} did not answer "
                                          r"within 0.3 s"):
        scorer_for(verifier.url, timeout_s=0.3, verifier_batch_size=4).score(texts_batch(rows))


@pytest.mark.parametrize("marker,match", [
    ("bad-count", "sent 3 scores for 4 responses"),
    ("not-json", "sent a reply that is not JSON"),
    ("not-number", "sent a score that is not a number at position 0 of its reply: 'high'"),
])
def test_verifier_malformed_replies_name_the_url(verifier, marker, match):
    rows = [*ROWS[:3], marker, *ROWS[4:]]
    with pytest.raises(RewardError, match=rf"reward verifier {verifier.url} {match}"):
        scorer_for(verifier.url, verifier_batch_size=4).score(texts_batch(rows))
    # with a policy, only the malformed row's request fails in the end: its row gets the fixed score
    scores, stats = scorer_for(verifier.url, verifier_batch_size=4, failure="score",
                               failure_score=-9.0).score(texts_batch(rows))
    assert scores[3] == -9.0 and stats.failures.rows_fixed_score == 1.0
    assert [s for i, s in enumerate(scores.tolist()) if i != 3] == [row_number(r) for r in rows if r != marker]


def test_verifier_refused_connection_is_retried_then_fails():
    with socket.socket() as s:  # a port on 127.0.0.1 where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    with pytest.raises(RewardError, match=rf"reward verifier {url} failed after 2 attempts: cannot connect"):
        HttpVerifier(url, retries=1, backoff_s=0.01)(["p"], ["r1"])
    with pytest.raises(RewardError, match="must be an http:// or https:// URL with a host"):
        HttpVerifier("http:///score")


class Recorder:
    """An HTTP service on 127.0.0.1 that records each request (method, target as sent, Host
    header) and answers every one with `code`, `headers` and `body`."""

    def __init__(self, code: int = 200, headers: dict | None = None, body: bytes = b'{"scores": [7.0]}'):
        self.requests: list[tuple[str, str, str]] = []
        service = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.answer()

            def do_GET(self):  # noqa: N802 - what a client that follows a 302 sends
                self.answer()

            def answer(self):
                service.requests.append((self.command, self.path, self.headers.get("Host")))
                self.send_response(code)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def recorders():
    made = []

    def make(**kw) -> Recorder:
        made.append(Recorder(**kw))
        return made[-1]
    yield make
    for service in made:
        service.close()


def test_verifier_follows_no_redirect(recorders):
    """A 302 to another host is a RewardError naming the URL and the Location, and that host is
    never contacted (a client that follows it would send there, and take its reply as scores)."""
    elsewhere = recorders()
    verifier = recorders(code=302, headers={"Location": f"{elsewhere.url}/steal"}, body=b"")
    url = f"{verifier.url}/score"
    with pytest.raises(RewardError, match=rf"reward verifier {url} answered HTTP 302 Found, a redirect to "
                                          rf"'{elsewhere.url}/steal': redirects are not followed"):
        HttpVerifier(url, retries=0)(["p"], ["r1"])
    assert [r[0] for r in verifier.requests] == ["POST"] and elsewhere.requests == []


def test_verifier_ignores_the_environment_proxy(recorders, monkeypatch):
    """http_proxy in the environment is never read: the request goes to the verifier itself."""
    proxy, verifier = recorders(body=b'{"scores": [-1.0]}'), recorders()
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, proxy.url)
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    # urllib's default opener reads the proxies once, at a process's first request: cleared, a
    # client on urllib (as the verifier was) would read them here, whatever ran before
    import urllib.request
    monkeypatch.setattr(urllib.request, "_opener", None)
    assert HttpVerifier(f"{verifier.url}/score", retries=0)(["p"], ["r1"]) == [7.0]
    assert proxy.requests == [] and [r[:2] for r in verifier.requests] == [("POST", "/score")]


def test_verifier_uses_the_configured_proxy(recorders):
    """reward_verifier_proxy: the request goes to the proxy, with the verifier's absolute URL and
    Host, as an HTTP proxy forwards it (here the stand-in proxy answers itself)."""
    from actors.reward import RewardScorer

    proxy, verifier = recorders(body=b'{"scores": [3.0]}'), recorders()
    url = f"{verifier.url}/score?task=arith"
    config = tiny_test_config(reward_funcs=[url], reward_weights=[], reward_verifier_proxy=proxy.url)
    scorer = RewardScorer.from_config(config, None)
    scores, _ = scorer.score(texts_batch(["r1"]))
    assert scores.tolist() == [3.0] and verifier.requests == []
    assert proxy.requests == [("POST", url, verifier.url.removeprefix("http://"))]
    with pytest.raises(RewardError, match="reward_verifier_proxy 'https://127.0.0.1:1' must be an http:// URL"):
        HttpVerifier(url, proxy="https://127.0.0.1:1")


def test_verifier_timeout_is_a_deadline_for_the_whole_call():
    """A service that trickles its reply, one byte every 0.2 s, each byte well within any one
    socket operation's limit: reward_timeout_s (1 s) still ends the call with a RewardTimeout
    naming the URL and the limit, long before the reply is through (the service counts the bytes
    it could send before the verifier shut the connection)."""
    from ppo_ray.rewards import RewardTimeout

    reply = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 17\r\n\r\n{"scores": [1.0]}'
    listener = socket.create_server(("127.0.0.1", 0))
    sent = []

    def trickle():
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)  # the request (small: one read holds it)
            for i in range(len(reply)):
                try:
                    conn.sendall(reply[i:i + 1])
                except OSError:  # the verifier shut the connection
                    break
                sent.append(i)
                time.sleep(0.2)  # the service's trickle: what is under test, not a wait in the test

    server = threading.Thread(target=trickle, daemon=True)
    server.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/score"
    try:
        with pytest.raises(RewardTimeout, match=rf"reward verifier {url} did not answer within 1 s \(reward_timeout_s"):
            HttpVerifier(url, timeout_s=1.0, retries=0)(["p"], ["r1"])
        server.join(timeout=60)  # its next send after the shutdown fails
        assert not server.is_alive()
        assert len(sent) < len(reply), f"the whole reply ({len(reply)} bytes) was read"
    finally:
        listener.close()
