"""``vllm-mmcache-fix status --url`` against a small HTTP server whose ``/metrics`` is what the
plugin's exporter (``metrics/exporter.py``) puts on prometheus_client's registry, as on a
vLLM server, and whose ``/health`` answers as the test says.

On a real vLLM server: ``tests/e2e/test_e2e_health.py`` (protected, and stuck).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import vllm_mmcache_fix
from harness.http import free_port
from harness.paths import REPO_ROOT
from vllm_mmcache_fix.metrics import names as n
from vllm_mmcache_fix.metrics.exporter import Exporter
from vllm_mmcache_fix.tools import exits, status
from vllm_mmcache_fix.tools.status import _parse_plain, parse_metrics, read_status

prom = pytest.importorskip("prometheus_client")

COUNTS = {"protected": 1, "ghost_keys_dropped": 0, "stalls": 0}
VLLM_ONLY = "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n"


class Server:
    """``/metrics`` from a callable, ``/health`` from another (status code, delay)."""

    def __init__(self) -> None:
        self.metrics: Callable[[], str] = lambda: prom.generate_latest(prom.REGISTRY).decode()
        self.health: Callable[[], tuple[int, float]] = lambda: (200, 0.0)
        self.health_calls = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/metrics":
                    code, body = 200, outer.metrics()
                elif self.path == "/health":
                    outer.health_calls += 1
                    code, delay = outer.health()
                    time.sleep(delay)
                    body = ""
                else:
                    code, body = 404, ""
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def exporter() -> Iterator[Callable[..., Exporter]]:
    made: list[Exporter] = []

    def make(local=COUNTS, engines=({"protected": 1},), ages=lambda: None) -> Exporter:
        exp = Exporter(lambda: local, lambda: list(engines), lambda exc: None, ages)
        exp.start()
        exp.observe_round_trip("EngineCore", 0.003)
        made.append(exp)
        return exp

    yield make
    for exp in made:
        exp.unregister()


def test_a_protected_server(server: Server, exporter) -> None:
    exporter()
    report = read_status(server.url, settle=0.1)
    assert report.verdict.value == "protected", report.summary
    assert report.exit_code == 0
    assert report.plugin_version == vllm_mmcache_fix.__version__
    assert report.protected == {"api_server": 1.0, "engine_core": 1.0}
    assert report.engines["EngineCore"]["round_trips_failed_after"] == 0
    assert server.health_calls == 1


def test_failing_round_trips_mean_stuck(server: Server, exporter) -> None:
    exp = exporter()

    def health() -> tuple[int, float]:
        exp.health_check_failed("EngineCore")  # what the plugin does when the engine is silent
        return 503, 0.0

    server.health = health
    report = read_status(server.url, settle=0.1)
    assert report.verdict.value == "stuck" and report.exit_code == exits.STUCK.code
    assert any("EngineCore: 1 /health round trip(s) failed" in e for e in report.evidence)
    assert any("/health answered 503" in e for e in report.evidence)
    assert "restart" in (report.remedy or "")


def test_a_failure_long_ago_is_not_stuck(server: Server, exporter) -> None:
    """The failure counter is cumulative: an engine that failed once, an hour ago, and
    answers now is not stuck."""
    exp = exporter()
    exp.health_check_failed("EngineCore")
    report = read_status(server.url, settle=0.1)
    assert report.verdict.value == "protected", report.summary
    assert report.engines["EngineCore"]["round_trips_failed_after"] == 1


def test_health_that_does_not_answer_means_stuck(server: Server, exporter) -> None:
    exporter()
    server.health = lambda: (200, 3.0)
    report = read_status(server.url, timeout=1.0, settle=0.1)
    assert report.verdict.value == "stuck"
    assert report.health_status is None and "did not answer in 1 s" in report.evidence[0]


@pytest.mark.parametrize(
    ("ages", "verdict"),
    [((5.0, 6.0), "protected"), ((40.0, 42.0), "stuck"), ((40.0, 40.0), "protected")],
)
def test_the_engine_answer_age_where_the_server_has_it(
    server: Server, exporter, ages: tuple[float, float], verdict: str
) -> None:
    reads = iter(ages)
    now: dict[str, float] = {}
    exp = exporter(ages=lambda: now)

    def metrics() -> str:
        # The plugin's own exporter, synced with the next age at each scrape.
        now["EngineCore_DP0"] = next(reads)
        exp.sync()
        return prom.generate_latest(prom.REGISTRY).decode()

    server.metrics = metrics
    report = read_status(server.url, settle=0.1, stuck_after=30.0)
    assert report.verdict.value == verdict, report.as_dict()
    assert report.engines["EngineCore_DP0"]["last_answer_age_s"] == ages[1]


def test_warn_mode_is_inactive(server: Server, exporter) -> None:
    exporter(local={**COUNTS, "protected": 0}, engines=({"protected": 0},))
    report = read_status(server.url, settle=0.1)
    assert report.verdict.value == "inactive" and report.exit_code == exits.INACTIVE.code


@pytest.mark.parametrize(("second", "verdict"), [(1, "protected"), (0, "inactive")])
def test_dp_engines_are_counted_not_summed(server: Server, exporter, second, verdict) -> None:
    # DP=2: the protected series counts protected EngineCores; with one of two in warn
    # mode the sum is 1, which alone would read "protected".
    ages = {"EngineCore_DP0": 0.5, "EngineCore_DP1": 0.7}
    exporter(engines=({"protected": 1}, {"protected": second}), ages=lambda: ages)
    report = read_status(server.url, settle=0.1)
    assert report.verdict.value == verdict, report.summary
    if verdict == "inactive":
        assert "only 1 of 2 EngineCores" in report.summary
        assert report.exit_code == exits.INACTIVE.code
    else:
        assert "2 EngineCore(s)" in report.summary


def test_no_plugin_series_is_unprotected(server: Server) -> None:
    server.metrics = lambda: VLLM_ONLY
    report = read_status(server.url, settle=0.1)
    assert report.verdict.value == "unprotected" and report.exit_code == exits.UNPROTECTED.code
    assert "vllm-mmcache-fix check" in (report.remedy or "")


def test_nothing_listening_is_unreachable() -> None:
    report = read_status(f"http://127.0.0.1:{free_port()}", timeout=2.0, settle=0.1)
    assert report.verdict.value == "unreachable" and report.exit_code == exits.UNREACHABLE.code


def test_the_plain_reader_matches_prometheus_client(exporter) -> None:
    """Without prometheus_client (a debug container) the same samples are read."""
    exp = exporter()
    exp.health_check_failed('Engine "quoted"')
    text = prom.generate_latest(prom.REGISTRY).decode()
    assert _parse_plain(text) == parse_metrics(text)
    assert any(name == n.BUILD_INFO for name, _ in parse_metrics(text))


def test_the_command_line(server: Server, exporter) -> None:
    exporter()
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "vllm_mmcache_fix", "status", "--url", server.url, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    data = json.loads(done.stdout)
    assert done.returncode == 0 == data["exit_code"], done.stdout + done.stderr
    assert data["verdict"] == "protected" and data["command"] == "status"
    text = subprocess.run(
        [sys.executable, "-m", "vllm_mmcache_fix", "status", "--url", server.url],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert text.stdout.splitlines()[-1].startswith("verdict: protected (exit 0)"), text.stdout


def _cache_exposition(evictions: int) -> str:
    sender = 'role="sender",engine=""'
    receiver = 'role="receiver",engine="EngineCore_DP1"'
    lines = [
        f"{n.MM_CACHE_BYTES}{{{sender}}} 750",
        f"{n.MM_CACHE_CAPACITY}{{{sender}}} 1000",
        f"{n.MM_CACHE_ENTRIES}{{{sender}}} 3",
        f"{n.MM_CACHE_EVICTIONS}{{{sender}}} {evictions}",
        f'{n.MM_CACHE_HITS}{{{sender},modality="image"}} 30',
        f'{n.MM_CACHE_MISSES}{{{sender},modality="image"}} 10',
        f'{n.MM_CACHE_MISSES}{{{sender},modality="video"}} 4',
        f"{n.MM_CACHE_BYTES}{{{receiver}}} 250",
        f"{n.MM_CACHE_CAPACITY}{{{receiver}}} 1000",
        f"{n.MM_CACHE_TOO_LARGE}{{{receiver}}} 2",
        f'{n.PROTECTED_PROCESSES}{{kind="api_server"}} 1',
    ]
    return "\n".join(lines) + "\n"


def test_the_caches_live_figures(server: Server) -> None:
    reads = iter([_cache_exposition(10), _cache_exposition(16)])
    server.metrics = lambda: next(reads, _cache_exposition(16))
    report = read_status(server.url, settle=0.5)
    sender = report.caches["sender"]
    assert sender["occupancy"] == 0.75 and sender["entries"] == 3
    assert sender["evictions"] == 16
    # 6 evictions between two reads at least 0.5 s apart: at most 720 a minute, more than 0.
    assert 0 < sender["evictions_per_min"] <= 6 * 60 / 0.5
    assert sender["hit_rate"] == {"image": 0.75, "video": 0.0}
    assert sender["lookups"] == {"image": 40.0, "video": 4.0}
    receiver = report.caches["receiver/EngineCore_DP1"]
    assert receiver["occupancy"] == 0.25 and receiver["too_large"] == 2
    assert "evictions_per_min" not in receiver
    assert report.as_dict()["caches"]["sender"]["hit_rate"]["image"] == 0.75


def test_the_command_line_shows_the_caches(server: Server) -> None:
    server.metrics = lambda: _cache_exposition(16)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    text = subprocess.run(
        [sys.executable, "-m", "vllm_mmcache_fix", "status", "--url", server.url],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    ).stdout
    line = next(x for x in text.splitlines() if x.startswith("mm cache") and "sender" in x)
    assert "75% full (750 of 1000 bytes)" in line and "image hit rate 75% of 40" in line, text
    assert "video hit rate 0% of 4" in line and "16 evictions (0/min just now)" in line, text
    assert any(
        "receiver/EngineCore_DP1" in x and "2 items too large" in x for x in text.splitlines()
    )


def test_each_unreachable_report_says_which_read_failed(monkeypatch) -> None:
    """A first ``/metrics`` that fails, and one that answers once then not (with what
    ``/health`` said in between), word for word."""
    answers = iter([(404, "", None)])
    monkeypatch.setattr(status, "_get", lambda url, timeout, **_: next(answers))
    first = read_status("http://h:1", settle=0.0)
    assert (first.verdict.value, first.summary, first.remedy) == (
        "unreachable",
        "cannot read http://h:1/metrics: HTTP 404",
        "check the URL (the server's own port, where /metrics is) and that the server is up",
    )
    assert (first.health_status, first.health_error) == (None, None)

    answers = iter([(200, VLLM_ONLY, None), (503, "", None), (None, "", "URLError: refused")])
    second = read_status("http://h:1", settle=0.0)
    assert (second.verdict.value, second.summary, second.remedy) == (
        "unreachable",
        "http://h:1/metrics answered once, then not: URLError: refused",
        "the API server itself stopped answering: check its process and log",
    )
    assert (second.health_status, second.health_error) == (503, None)


# --------------------------------------------------------------------------- what --url may be


@pytest.mark.parametrize("path", ["", "/", "/v1", "/v1/"])
def test_the_openai_base_url_reads_the_servers_root(server: Server, path: str) -> None:
    """``http://HOST:PORT/v1`` (what OpenAI clients are given) read ``/v1/metrics``: a 404,
    exit 10 ``unreachable`` for a server that was up."""
    server.metrics = lambda: VLLM_ONLY
    assert status.normalize_url(server.url + path) == server.url
    report = read_status(server.url + path, timeout=5.0, settle=0.0)
    assert report.verdict.value == "unprotected", report.summary
    assert report.url == server.url


def test_credentials_in_the_url_are_sent_as_basic_auth(server: Server) -> None:
    """urllib does not send a URL's user and password: a server behind Basic auth answered
    401, and a password with an ``@`` was a host name (``Name or service not known``)."""
    seen: list[str | None] = []

    class Handler(server.httpd.RequestHandlerClass):  # type: ignore[misc]
        def do_GET(self) -> None:  # noqa: N802
            seen.append(self.headers.get("Authorization"))
            if self.headers.get("Authorization") is None:
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="m"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            super().do_GET()

    server.httpd.RequestHandlerClass = Handler
    server.metrics = lambda: VLLM_ONLY
    host = server.url.removeprefix("http://")
    report = read_status(f"http://ops:p%40ss@w0rd@{host}/v1", timeout=5.0, settle=0.0)
    assert report.verdict.value == "unprotected", report.summary
    expected = "Basic " + base64.b64encode(b"ops:p@ss@w0rd").decode()
    assert seen and all(header == expected for header in seen), seen
    assert report.url == f"http://ops:<redacted>@{host}"
    assert "w0rd" not in json.dumps(report.as_dict())


def test_a_trickling_metrics_page_is_bounded_by_the_timeout(server: Server) -> None:
    """urllib's timeout is per socket read: 10 bytes every 0.5 s held ``--timeout 1`` for
    ever."""
    server.metrics = lambda: VLLM_ONLY * 50

    class Handler(server.httpd.RequestHandlerClass):  # type: ignore[misc]
        def do_GET(self) -> None:  # noqa: N802
            data = (VLLM_ONLY * 50).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            for start in range(0, len(data), 10):
                try:
                    self.wfile.write(data[start : start + 10])
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.5)

    server.httpd.RequestHandlerClass = Handler
    started = time.monotonic()
    report = read_status(server.url, timeout=1.0, settle=0.0)
    assert time.monotonic() - started < 3.0
    assert report.verdict.value == "unreachable" and report.exit_code == exits.UNREACHABLE.code
    assert "TimeoutError" in report.summary and "1 s" in report.summary, report.summary


def test_a_metrics_page_cut_short_is_unreachable(server: Server) -> None:
    """The server closes before the length it announced: http.client's IncompleteRead."""

    class Handler(server.httpd.RequestHandlerClass):  # type: ignore[misc]
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(VLLM_ONLY.encode()[:20])
            self.close_connection = True

    server.httpd.RequestHandlerClass = Handler
    report = read_status(server.url, timeout=5.0, settle=0.0)
    assert report.verdict.value == "unreachable", report.summary
    assert "IncompleteRead" in report.summary, report.summary


def test_a_metrics_page_over_the_size_cap_is_not_read(server: Server, monkeypatch) -> None:
    monkeypatch.setattr(status, "MAX_BODY_BYTES", 4096)
    server.metrics = lambda: VLLM_ONLY * 100
    report = read_status(server.url, timeout=5.0, settle=0.0)
    assert report.verdict.value == "unreachable", report.summary
    assert "larger than" in report.summary, report.summary


NOT_METRICS = {
    "html": "<!DOCTYPE html>\n<html><body><form>Log in</form></body></html>\n",
    "bad label": f'{n.PROTECTED_PROCESSES}{{kind="api_server"}} 1\n'
    f'{n.PROTECTED_PROCESSES}{{kind="engine_core" 1\n',
    "prose": 'vllm:foo{a="b"} 1\nthis is not prometheus\n',
    "bad value": f'{n.PROTECTED_PROCESSES}{{kind="api_server"}} one\n',
}


@pytest.mark.parametrize("plain", [False, True], ids=["prometheus_client", "plain"])
@pytest.mark.parametrize("kind", sorted(NOT_METRICS))
def test_a_page_that_is_not_metrics_cannot_be_read(
    server: Server, monkeypatch, kind: str, plain: bool
) -> None:
    """One answer with or without prometheus_client: it raised ValueError (exit 1), and the
    plain reader skipped the bad lines (``unprotected`` or ``protected``)."""
    if plain:
        monkeypatch.setitem(sys.modules, "prometheus_client.parser", None)
    body = NOT_METRICS[kind]
    with pytest.raises(status.NotMetricsError):
        parse_metrics(body)
    server.metrics = lambda: body
    report = read_status(server.url, timeout=5.0, settle=0.0)
    assert report.verdict.value == "unreachable", report.summary
    assert "not a Prometheus metrics page" in report.summary, report.summary
    assert ("HTML" in report.summary) == (kind == "html"), report.summary


def test_both_readers_accept_what_the_format_allows() -> None:
    text = (
        "# HELP x y\n\n"
        f'{n.PROTECTED_PROCESSES}{{kind="api_server",}} 1 1700000000000\n'
        f'{n.ENGINE_LAST_ANSWER_AGE}{{engine="0"}} NaN\n'
        f"{n.STALLS} +Inf\n"
        "# EOF\n"
    )
    plain = _parse_plain(text)
    assert set(plain) == set(parse_metrics(text))
    assert plain[(n.PROTECTED_PROCESSES, (("kind", "api_server"),))] == 1.0
