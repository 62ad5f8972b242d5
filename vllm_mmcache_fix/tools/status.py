"""``vllm-mmcache-fix status --url``: is a running server protected, and is it stuck?

Reads the server's own ``/metrics`` (the plugin's series, ``metrics/names.py``), asks
``/health`` once and reads ``/metrics`` again a little later, then answers:

- ``unreachable``: ``/metrics`` could not be read;
- ``stuck``: an EngineCore does not answer. The evidence, any one of: ``/health`` answered
  503 (the plugin's verdict from its heartbeat: it never waits on EngineCore) or did not
  answer in ``timeout`` seconds while ``/metrics`` did; the plugin's
  ``mmcache_fix_engine_stuck_health_checks_total`` (or its former name) rose for an engine
  between the two reads;
  ``mmcache_fix_engine_last_answer_age_seconds``, where the server has it, above
  ``stuck_after`` seconds and still growing;
- ``unprotected``: no ``mmcache_fix_*`` series at all: the API server did not load the
  plugin (not installed, left out by ``VLLM_PLUGINS``, ``MMCACHE_FIX_MODE=off``);
- ``inactive``: the plugin is loaded but no process is protected (``MMCACHE_FIX_MODE=warn``)
  or EngineCore reports itself unprotected;
- ``protected``: otherwise.

A busy server is not stuck: a long step delays no answer (EngineCore's input thread answers
the plugin's heartbeat whatever the busy loop does). Reads only; nothing on the server
changes (``/health`` is what load balancers call anyway).
Imports neither vLLM nor anything the wheel does not ship: it runs from a debug container.
"""

from __future__ import annotations

import http.client
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from ..metrics import names as n
from . import exits
from .exits import Verdict
from .redact import REDACTED

DEFAULT_TIMEOUT_S = 15.0
"""Per request, the whole of it (connecting, the answer's head, its body). ``/metrics`` and
``/health`` answer at once, a stuck engine or not (the plugin's ``/health`` reads its
heartbeat's verdict and never waits on EngineCore), so this only bounds an API server that
does not answer at all, or answers a byte at a time."""
MAX_BODY_BYTES = 16 * 1024 * 1024
"""The largest ``/metrics`` read. vLLM's is tens of kilobytes (a few hundred kilobytes with
many engines and models); more is not read into memory, and is reported."""
_CHUNK_BYTES = 64 * 1024
BASE_PATHS = ("", "/", "/v1", "/v1/")
"""Paths of ``--url`` reduced to the server's root: ``/v1`` is the OpenAI base URL users
copy; ``/metrics`` and ``/health`` are at the root."""
DEFAULT_STUCK_AFTER_S = 30.0
"""An engine whose last answer is older than this (and getting older) is stuck."""
SETTLE_S = 1.5
"""Between ``/health`` and the second read: the plugin syncs its metrics once a second."""


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""``{(name, sorted labels): value}``"""
Credentials = tuple[str, str]
"""``(user, password)`` from the URL, percent-escapes decoded."""


@dataclass
class StatusReport:
    url: str
    verdict: Verdict
    summary: str
    remedy: str | None = None
    plugin_version: str | None = None
    vllm_version: str | None = None
    health_status: int | None = None
    """``/health``'s HTTP status; None when it did not answer."""
    health_error: str | None = None
    protected: dict[str, float] = field(default_factory=dict)
    """``mmcache_fix_protected_processes`` by ``kind``."""
    engines: dict[str, dict[str, float | None]] = field(default_factory=dict)
    """Per engine: failed round trips before and after, last answer age."""
    evidence: list[str] = field(default_factory=list)
    """Why the verdict is ``stuck`` (one sentence each)."""
    counters: dict[str, float] = field(default_factory=dict)
    """The plugin's other counters, summed over labels (repairs, drift, stalls, errors)."""
    caches: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per multimodal cache (``role`` or ``role/engine``): bytes, capacity, occupancy,
    entries, evictions (total, and per minute between the two reads), items too large,
    and the hit rate per modality since the server started (:func:`cache_figures`)."""

    @property
    def exit_code(self) -> int:
        return self.verdict.code.code

    def as_dict(self) -> dict[str, Any]:
        return exits.record_envelope(
            "status",
            self,
            protected=dict(self.protected),
            engines=dict(self.engines),
            evidence=list(self.evidence),
            counters=dict(self.counters),
            caches={k: dict(v) for k, v in self.caches.items()},
        )


# --------------------------------------------------------------------------- reading


class NotMetricsError(ValueError):
    """A body that is not a Prometheus text exposition (an HTML login page, a proxy's error
    page, another service's answer, a broken line); the message says where."""


def parse_metrics(text: str) -> Samples:
    """The ``mmcache_fix_*`` samples of a Prometheus text exposition.

    prometheus_client's parser when it is installed (it comes with vLLM); otherwise a
    reader of the plain ``name{labels} value`` lines, because this command must also run
    from a debug container that has only this package. Both refuse the same bodies: any
    line that is neither a comment nor a sample raises :class:`NotMetricsError`."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        return _parse_plain(text)
    _check_lines(text)
    out: Samples = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith(n.PREFIX):
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    out[key] = float(sample.value)
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise NotMetricsError(f"{type(exc).__name__}: {exc}"[:200]) from None
    return out


_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+(\S+))?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_LABELS = re.compile(r'^\s*(?:[a-zA-Z_][a-zA-Z0-9_]*\s*=\s*"(?:[^"\\]|\\.)*"\s*(?:,\s*|$))*$')


def _check_lines(text: str) -> None:
    """:class:`NotMetricsError` at the first line that is neither a comment nor a sample."""
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line and not line.startswith("#") and _sample(line) is None:
            what = "HTML (a login or error page?)" if _is_html(text) else "not a sample"
            raise NotMetricsError(f"line {number} is {what}: {line[:80]!r}")


def _is_html(text: str) -> bool:
    head = text.lstrip()[:200].lower()
    return head.startswith("<") and ("<html" in head or "<!doctype" in head or "<body" in head)


def _sample(line: str) -> tuple[str, tuple[tuple[str, str], ...], float] | None:
    """``(name, sorted labels, value)`` of one sample line; None when it is not one."""
    match = _LINE.match(line)
    if match is None or not _LABELS.match(match.group(2) or ""):
        return None
    try:
        value = float(match.group(3))
        if match.group(4) is not None:
            float(match.group(4))  # the timestamp
    except ValueError:
        return None
    labels = tuple(sorted((k, _unescape(v)) for k, v in _LABEL.findall(match.group(2) or "")))
    return match.group(1), labels, value


def _parse_plain(text: str) -> Samples:
    _check_lines(text)
    out: Samples = {}
    for line in text.splitlines():
        if line.startswith(n.PREFIX):
            sample = _sample(line.strip())
            if sample is not None:
                out[(sample[0], sample[1])] = sample[2]
    return out


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def _get(
    url: str, timeout: float, *, credentials: Credentials | None = None, read_body: bool = True
) -> tuple[int | None, str, str | None]:
    """(status, body, error) of one GET, the whole request within ``timeout`` seconds.

    urllib's timeout bounds each socket operation only (a server that sends a byte every
    second would hold it for ever), so the request runs in a daemon thread that reads the
    body in chunks and stops at the deadline; past it, this returns a timeout and leaves
    the thread to end at its next chunk. A body over :data:`MAX_BODY_BYTES` is an error.
    Without ``read_body`` (``/health``) only the status is read."""
    deadline = time.monotonic() + timeout
    outcome: list[tuple[int | None, str, str | None]] = []

    def fetch() -> None:
        outcome.append(_fetch(url, timeout, deadline, credentials, read_body))

    worker = threading.Thread(target=fetch, name="vllm-mmcache-fix-status-get", daemon=True)
    worker.start()
    worker.join(timeout)
    if not outcome:
        return None, "", f"TimeoutError: no whole answer in {timeout:g} s"
    return outcome[0]


def _fetch(
    url: str, timeout: float, deadline: float, credentials: Credentials | None, read_body: bool
) -> tuple[int | None, str, str | None]:
    try:
        with _opener(url, credentials).open(url, timeout=timeout) as response:
            if not read_body:
                return response.status, "", None
            body, error = _read_body(response, deadline, timeout)
            return response.status, body, error
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code, "", None
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", exc)
        return None, "", f"{type(exc).__name__}: {reason}"


def _opener(url: str, credentials: Credentials | None) -> urllib.request.OpenerDirector:
    """urllib's opener; with credentials, one that sends them with every request to
    ``url``'s scheme, host and port (HTTP Basic auth, without waiting for a 401)."""
    if credentials is None:
        return urllib.request.build_opener()
    parsed = urllib.parse.urlsplit(url)
    passwords = urllib.request.HTTPPasswordMgrWithPriorAuth()
    passwords.add_password(
        None, f"{parsed.scheme}://{parsed.netloc}/", *credentials, is_authenticated=True
    )
    return urllib.request.build_opener(urllib.request.HTTPBasicAuthHandler(passwords))


def _read_body(response: Any, deadline: float, timeout: float) -> tuple[str, str | None]:
    """The body, chunk by chunk, up to the deadline and :data:`MAX_BODY_BYTES`."""
    chunks: list[bytes] = []
    size = 0
    while True:
        if time.monotonic() > deadline:
            return "", f"TimeoutError: the body took more than {timeout:g} s"
        chunk = response.read1(_CHUNK_BYTES)
        if not chunk:
            missing = getattr(response, "length", None)  # what Content-Length still owes
            if missing:
                return "", f"IncompleteRead: the body ended {missing} bytes short"
            return b"".join(chunks).decode("utf-8", "replace"), None
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            limit = MAX_BODY_BYTES // (1024 * 1024)
            return "", f"the body is larger than {limit} MiB (not a vLLM /metrics page?)"
        chunks.append(chunk)


def _series(samples: Samples, name: str, label: str) -> dict[str, float]:
    """``{label value: sample}`` of one metric."""
    out: dict[str, float] = {}
    for (sample_name, labels), value in samples.items():
        if sample_name == name:
            out[dict(labels).get(label, "")] = value
    return out


def _total(samples: Samples, name: str) -> float:
    return sum(v for (sample_name, _), v in samples.items() if sample_name == name)


def cache_figures(before: Samples, after: Samples, interval: float) -> dict[str, dict[str, Any]]:
    """The live figures of each multimodal cache from two reads ``interval`` seconds apart."""
    caches: dict[str, dict[str, Any]] = {}

    def key_of(labels: tuple[tuple[str, str], ...]) -> str:
        found = dict(labels)
        return found.get("role", "?") + (f"/{found['engine']}" if found.get("engine") else "")

    def entry(labels: tuple[tuple[str, str], ...]) -> dict[str, Any]:
        return caches.setdefault(key_of(labels), {"hit_rate": {}, "lookups": {}})

    plain = {
        n.MM_CACHE_BYTES: "bytes",
        n.MM_CACHE_CAPACITY: "capacity_bytes",
        n.MM_CACHE_ENTRIES: "entries",
        n.MM_CACHE_EVICTIONS: "evictions",
        n.MM_CACHE_TOO_LARGE: "too_large",
    }
    hits: dict[tuple[str, str], float] = {}
    misses: dict[tuple[str, str], float] = {}
    for (name, labels), value in after.items():
        if name in plain:
            entry(labels)[plain[name]] = value
        elif name in (n.MM_CACHE_HITS, n.MM_CACHE_MISSES):
            entry(labels)
            key = key_of(labels)
            modality = dict(labels).get("modality", "?")
            book = hits if name == n.MM_CACHE_HITS else misses
            book[(key, modality)] = book.get((key, modality), 0.0) + value
    for key, modality in sorted(set(hits) | set(misses)):
        found, missed = hits.get((key, modality), 0.0), misses.get((key, modality), 0.0)
        caches[key]["lookups"][modality] = found + missed
        caches[key]["hit_rate"][modality] = found / (found + missed) if found + missed else None
    evicted_before = {
        labels: value for (name, labels), value in before.items() if name == n.MM_CACHE_EVICTIONS
    }
    for (name, labels), value in after.items():
        if name == n.MM_CACHE_EVICTIONS and labels in evicted_before and interval > 0:
            rate = max(0.0, value - evicted_before[labels]) * 60.0 / interval
            entry(labels)["evictions_per_min"] = rate
    for figures in caches.values():
        capacity = figures.get("capacity_bytes")
        if capacity and "bytes" in figures:
            figures["occupancy"] = figures["bytes"] / capacity
    return caches


# --------------------------------------------------------------------------- the verdict


def normalize_url(url: str) -> str:
    """The server's base URL, ``scheme://[user:password@]host[:port]``, from what
    ``--url`` was given; ValueError (a usage error) naming what is wrong with a URL this
    command cannot read.

    ``host:port`` means ``http://host:port``; a path of ``/``, ``/v1`` or ``/v1/`` (the
    OpenAI base URL) is dropped, since ``/metrics`` and ``/health`` are at the root. Any
    other path, a query, a fragment, another scheme, no host, a port that is not a
    number, spaces or control characters are refused. Credentials stay (sent as HTTP
    Basic auth, :func:`split_credentials`)."""
    text = url.strip()
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:/(?!/)", text):
        raise ValueError(f"{url!r}: one slash after the scheme; e.g. http://HOST:8000")
    if "://" not in text:
        text = "http://" + text
    if any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in text):
        raise ValueError(f"{url!r} contains a space or a control character")
    try:
        parsed = urllib.parse.urlsplit(text)
    except ValueError as exc:
        raise ValueError(f"{url!r} is not a valid URL ({exc}); e.g. http://HOST:8000") from None
    try:
        parsed.port  # noqa: B018 - raises for a port that is not a number
    except ValueError:
        raise ValueError(f"{url!r} has no valid port; e.g. http://HOST:8000") from None
    if parsed.scheme.lower() not in ("http", "https"):
        raise ValueError(f"{url!r}: only http:// and https:// URLs, e.g. http://HOST:8000")
    if not parsed.hostname:
        raise ValueError(
            f"{url!r} names no host; give the server's base URL, e.g. http://HOST:8000"
        )
    if parsed.query or parsed.fragment or text.endswith(("?", "#")):
        raise ValueError(
            f"{url!r} has a query or a fragment; give the server's base URL, e.g. http://HOST:8000"
        )
    if parsed.path not in BASE_PATHS:
        raise ValueError(
            f"{url!r} has the path {parsed.path!r}; give the server's base URL (e.g. "
            "http://HOST:8000, or .../v1): /metrics and /health are read at its root"
        )
    return f"{parsed.scheme.lower()}://{parsed.netloc}"


def split_credentials(base: str) -> tuple[str, Credentials | None]:
    """``(base without user:password@, the credentials or None)``.

    urllib does not send a URL's credentials by itself; :func:`_get` sends them as HTTP
    Basic auth to this scheme, host and port only (also after a redirect there, never
    after one elsewhere)."""
    parsed = urllib.parse.urlsplit(base)
    if parsed.username is None and parsed.password is None:
        return base, None
    host = parsed.netloc.rpartition("@")[2]
    user = urllib.parse.unquote(parsed.username or "")
    password = urllib.parse.unquote(parsed.password or "")
    return f"{parsed.scheme}://{host}", (user, password)


def shown_url(base: str) -> str:
    """``base`` as reports print it: a password replaced by ``<redacted>``."""
    parsed = urllib.parse.urlsplit(base)
    if parsed.password is None:
        return base
    host = parsed.netloc.rpartition("@")[2]
    return f"{parsed.scheme}://{parsed.username or ''}:{REDACTED}@{host}"


def read_status(
    url: str,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    stuck_after: float = DEFAULT_STUCK_AFTER_S,
    settle: float = SETTLE_S,
) -> StatusReport:
    base = normalize_url(url)
    shown = shown_url(base)
    target, credentials = split_credentials(base)
    before, why, remedy = _read_metrics(target, timeout, credentials)
    if before is None:
        return _unreachable(shown, f"cannot read {shown}/metrics: {why}", remedy)
    first_read = time.monotonic()
    health, _, health_error = _get(
        target + "/health", timeout, credentials=credentials, read_body=False
    )
    time.sleep(settle)
    after, why, remedy = _read_metrics(target, timeout, credentials)
    if after is None:
        summary = f"{shown}/metrics answered once, then not: {why}"
        if remedy == _REMEDY_NO_METRICS:
            remedy = _REMEDY_STOPPED
        return _unreachable(shown, summary, remedy, health_status=health, health_error=health_error)
    report = decide(shown, before, after, health, health_error, timeout, stuck_after)
    report.caches = cache_figures(before, after, time.monotonic() - first_read)
    return report


_REMEDY_NO_METRICS = (
    "check the URL (the server's own port, where /metrics is) and that the server is up"
)
_REMEDY_STOPPED = "the API server itself stopped answering: check its process and log"
_REMEDY_NOT_METRICS = (
    "give the vLLM server's own port (where /metrics is), not a proxy or login page in front of it"
)


def _read_metrics(
    base: str, timeout: float, credentials: Credentials | None
) -> tuple[Samples | None, str, str]:
    """``/metrics``' samples, or None, why they could not be read, and what to do."""
    code, body, error = _get(base + "/metrics", timeout, credentials=credentials)
    if code != 200 or error is not None:
        return None, error or f"HTTP {code}", _REMEDY_NO_METRICS
    try:
        return parse_metrics(body), "", ""
    except NotMetricsError as exc:
        return None, f"it is not a Prometheus metrics page: {exc}", _REMEDY_NOT_METRICS


def _unreachable(
    base: str,
    summary: str,
    remedy: str,
    *,
    health_status: int | None = None,
    health_error: str | None = None,
) -> StatusReport:
    return StatusReport(
        base,
        Verdict.UNREACHABLE,
        summary,
        remedy=remedy,
        health_status=health_status,
        health_error=health_error,
    )


def decide(
    url: str,
    before: Samples,
    after: Samples,
    health: int | None,
    health_error: str | None,
    timeout: float = DEFAULT_TIMEOUT_S,
    stuck_after: float = DEFAULT_STUCK_AFTER_S,
) -> StatusReport:
    """The verdict from two reads of ``/metrics`` and one ``/health`` between them."""
    report = StatusReport(url, Verdict.PROTECTED, "", health_status=health)
    report.health_error = health_error
    for (name, labels), _ in after.items():
        if name == n.BUILD_INFO:
            found = dict(labels)
            report.plugin_version = found.get("version")
            report.vllm_version = found.get("vllm_version")
    report.protected = _series(after, n.PROTECTED_PROCESSES, "kind")
    report.counters = {
        name: _total(after, name)
        for name in (n.CACHE_REPAIRS, n.DRIFT_EVENTS, n.STALLS, n.INTERNAL_ERRORS)
        if any(s == name for s, _ in after)
    }

    # A server whose plugin predates the rename has the former name only.
    failed_before = _series(before, n.STUCK_HEALTH_CHECKS, "engine") or _series(
        before, n.DEPRECATED_ROUND_TRIPS_FAILED, "engine"
    )
    failed_after = _series(after, n.STUCK_HEALTH_CHECKS, "engine") or _series(
        after, n.DEPRECATED_ROUND_TRIPS_FAILED, "engine"
    )
    age_before = _series(before, n.ENGINE_LAST_ANSWER_AGE, "engine")
    age_after = _series(after, n.ENGINE_LAST_ANSWER_AGE, "engine")
    for engine in sorted(set(failed_after) | set(age_after)):
        report.engines[engine] = {
            "round_trips_failed_before": failed_before.get(engine),
            "round_trips_failed_after": failed_after.get(engine),
            "last_answer_age_s": age_after.get(engine),
        }
        rose = failed_after.get(engine, 0.0) - failed_before.get(engine, 0.0)
        if rose > 0:
            report.evidence.append(
                f"{engine}: {rose:g} /health round trip(s) failed just now (it did not "
                "answer the plugin in time)"
            )
        age = age_after.get(engine)
        if age is not None and age > stuck_after and age > age_before.get(engine, -1.0):
            report.evidence.append(
                f"{engine}: last answered {age:.0f} s ago (more than {stuck_after:g} s) and "
                "still not answering"
            )
    if health is not None and health >= 500:
        report.evidence.append(f"/health answered {health}")
    elif health is None:
        report.evidence.append(
            f"/health did not answer in {timeout:g} s ({health_error}) while /metrics did"
        )

    if report.evidence:
        report.verdict = Verdict.STUCK
        report.summary = "an EngineCore does not answer: " + "; ".join(report.evidence)
        report.remedy = (
            "restart the server; before that, `vllm-mmcache-fix diagnose --pid <PID>` on its "
            "host keeps the evidence (README: A server is frozen right now)"
        )
        return report
    if not after:
        report.verdict = Verdict.UNPROTECTED
        report.summary = (
            "no mmcache_fix_* series on /metrics: this server's API server did not load "
            "vllm-mmcache-fix (not installed, left out by VLLM_PLUGINS, or MMCACHE_FIX_MODE=off)"
        )
        report.remedy = "run `vllm-mmcache-fix check` in the server's environment"
        return report
    api = report.protected.get(n.KIND_API_SERVER, 0.0)
    engines = report.protected.get(n.KIND_ENGINE_CORE)
    # The protected series counts protected EngineCores; the engines the API server hears
    # from (one last-answer series each) say how many there are: with DP=2, one protected
    # engine out of two is not a protected server.
    known = len(age_after)
    if engines is not None and known > engines >= 1:
        report.verdict = Verdict.INACTIVE
        report.summary = (
            f"vllm-mmcache-fix {report.plugin_version or ''} is loaded, but only {engines:g} of "
            f"{known} EngineCores report a protected cache (MMCACHE_FIX_MODE=warn in some, or "
            "a different vLLM or plugin in some engines' environment)"
        ).replace("  ", " ")
        report.remedy = "run `vllm-mmcache-fix check` in each engine's environment"
        return report
    if api < 1 or (engines is not None and engines < 1):
        report.verdict = Verdict.INACTIVE
        who = "the API server" if api < 1 else "EngineCore"
        report.summary = (
            f"vllm-mmcache-fix {report.plugin_version or ''} is loaded, but {who} reports no "
            "protected cache (MMCACHE_FIX_MODE=warn, or the plugin does not know this vLLM's "
            "layout)"
        ).replace("  ", " ")
        report.remedy = "run `vllm-mmcache-fix check` in the server's environment"
        return report
    report.summary = (
        f"vllm-mmcache-fix {report.plugin_version or '?'} protects vLLM "
        f"{report.vllm_version or '?'}: {api:g} API server(s)"
        + (
            f", {engines:g} EngineCore(s)"
            if engines is not None
            else "; EngineCore has not answered its first heartbeat yet"
        )
        + ("; every engine answers" if report.engines else "")
    )
    return report
