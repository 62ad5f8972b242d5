"""Secrets never leave the operator tools: ``diagnose``, ``check`` and ``status`` output.

The helper (``tools/redact.py``) is tested on generated command lines and texts; the
commands on real processes: ``diagnose`` of a process started with ``--api-key sk-...``
(text and ``--json``), ``check`` with secret-named variables, ``status`` with a password
in its URL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.children import Children, read_line, time_limit
from harness.paths import REPO_ROOT
from vllm_mmcache_fix.tools.redact import (
    REDACTED,
    is_sensitive,
    redact_argv,
    redact_data,
    redact_text,
)

SECRET = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.+/",
    min_size=6,
    max_size=40,
).map(lambda s: "Zq9" + s)
"""A secret's value: distinctive enough not to appear in the rest of a command line."""

WORD = st.sampled_from(["token", "secret", "key", "password", "TOKEN", "Secret", "KEY", "Password"])
NAME = st.builds(
    lambda pre, word, post: f"{pre}{word}{post}",
    st.sampled_from(["", "hf-", "api-", "db_", "my-", "x"]),
    WORD,
    st.sampled_from(["", "-file", "_id", "s", "-value"]),
)
PLAIN_ARGS = st.lists(
    st.sampled_from(
        ["serve", "/models/qwen", "--port", "8000", "--enforce-eager", "--max-model-len", "512"]
    ),
    max_size=6,
)


@pytest.fixture(autouse=True)
def _time_limit() -> Iterator[None]:
    with time_limit(120):
        yield


@given(before=PLAIN_ARGS, after=PLAIN_ARGS, name=NAME, secret=SECRET, joined=st.booleans())
def test_argv_never_keeps_a_secret_value(
    before: list[str], after: list[str], name: str, secret: str, joined: bool
) -> None:
    option = f"--{name}"
    argv = [*before, *([f"{option}={secret}"] if joined else [option, secret]), *after]
    out = redact_argv(argv)
    assert secret not in " ".join(out)
    assert option in " ".join(out)  # the report still says the option was given
    assert redact_argv(out) == out  # idempotent
    assert secret not in redact_text(" ".join(argv))


@given(args=PLAIN_ARGS)
def test_plain_arguments_are_kept(args: list[str]) -> None:
    assert redact_argv(args) == args
    assert redact_text(" ".join(args)) == " ".join(args)


@given(name=NAME, secret=SECRET, quote=st.sampled_from(["", "'", '"']))
def test_text_assignments_and_fields(name: str, secret: str, quote: str) -> None:
    var = name.upper().replace("-", "_")
    for text in (
        f"env {var}={quote}{secret}{quote} vllm serve m",
        f"error: {{'{name}': '{secret}', 'port': 8000}}",
        f'{{"{name}": "{secret}"}}',
        f"Authorization: Bearer {secret}",
    ):
        out = redact_text(text)
        assert secret not in out, (text, out)
        assert REDACTED in out


@given(name=NAME, secret=SECRET)
def test_data_values_of_sensitive_keys(name: str, secret: str) -> None:
    data = {
        "cmdline": f"vllm serve m --{name} {secret}",
        name: secret,
        "nested": [{"text": f"{name}={secret}"}],
        "count": 3,
        "api_key_set": True,
    }
    out = redact_data(data)
    assert secret not in json.dumps(out)
    assert out["count"] == 3 and out["api_key_set"] is True


def test_everything_under_a_secrets_name_is_redacted() -> None:
    data = {"token": {"value": "Zq9abc", "scopes": ["Zq9read"]}, "port": 8000}
    assert redact_data(data) == {
        "token": {"value": REDACTED, "scopes": [REDACTED]},
        "port": 8000,
    }


def test_the_named_options_and_words() -> None:
    for name in ("--api-key", "--hf-token", "--ssl-keyfile", "HF_TOKEN", "DB_PASSWORD", "Secret"):
        assert is_sensitive(name), name
    for name in ("--port", "--model", "--max-model-len", "MMCACHE_FIX_MODE"):
        assert not is_sensitive(name), name
    assert redact_argv(["--api-key", "--port", "1"]) == ["--api-key", "--port", "1"]
    assert redact_text("http://user:pw123@host:8000/") == f"http://user:{REDACTED}@host:8000/"


@given(name=NAME, secret=SECRET, quote=st.sampled_from(["'", '"']), depth=st.integers(1, 4))
def test_a_secret_nested_in_a_mapping_at_any_depth(
    name: str, secret: str, quote: str, depth: int
) -> None:
    q = quote
    inner = f"{{{q}{name}{q}: {q}{secret}{q}, {q}port{q}: 8000}}"
    for level in range(depth):
        inner = f"{{{q}level_{level}_config{q}: {inner}}}"
    for text in (inner, f"error: bad config {inner}", f"--kv-transfer-config {inner}"):
        out = redact_text(text)
        assert secret not in out, (text, out)
        assert f"{q}{name}{q}: {q}{REDACTED}{q}" in out
        assert f"{q}port{q}: 8000" in out
        assert redact_text(out) == out
    argv = ["vllm", "serve", "m", "--kv-transfer-config", inner, "--port", "8000"]
    assert secret not in " ".join(redact_argv(argv))


def test_the_json_option_value_of_the_report() -> None:
    config = '{"kv_connector_extra_config": {"api_key": "sk-abc"}}'
    assert (
        redact_text('{"a_config": {"api_key": "x"}}')
        == f'{{"a_config": {{"api_key": "{REDACTED}"}}}}'
    )
    assert "sk-abc" not in " ".join(redact_argv(["serve", "--kv-transfer-config", config]))
    assert "'x'" not in redact_text("{'a_config': {'api_key': 'x'}}")
    listed = redact_text('{"api_keys": ["k1", "k2"], "n": 1}')
    assert "k1" not in listed and "k2" not in listed and '"n": 1' in listed
    data = redact_data({"api_keys": ["k1", "k2"], "cfg": {"inner": {"token": "t0k"}}})
    assert data == {"api_keys": [REDACTED, REDACTED], "cfg": {"inner": {"token": REDACTED}}}


@given(secrets=st.lists(SECRET, min_size=1, max_size=4), after=PLAIN_ARGS)
def test_every_value_of_a_multi_value_option(secrets: list[str], after: list[str]) -> None:
    argv = ["vllm", "serve", "m", "--api-key", *secrets, "--port", "8000", *after]
    out = redact_argv(argv)
    assert (
        out
        == ["vllm", "serve", "m", "--api-key", *[REDACTED] * len(secrets)]
        + argv[4 + len(secrets) :]
    )
    text = redact_text(" ".join(argv))
    assert not any(secret in text for secret in secrets), text
    assert text.endswith(" ".join(["--port", "8000", *after]))


def test_a_single_value_option_hides_one_argument() -> None:
    assert redact_argv(["--hf-token", "t", "model"]) == ["--hf-token", REDACTED, "model"]
    assert redact_argv(["--api-key=k1", "model"]) == [f"--api-key={REDACTED}", "model"]


def test_a_url_password_runs_to_the_last_at_sign() -> None:
    for url in (
        "http://user:p@ss@127.0.0.1:18001",
        "http://user:p@ss@127.0.0.1:18001/metrics",
        "https://user:a@b:c@host",
    ):
        out = redact_text(f"cannot read {url}: refused")
        assert out.startswith(f"cannot read {url.split(':', 2)[0]}://user:{REDACTED}@"), out
        assert "ss@" not in out and "b:c" not in out, out


# --------------------------------------------------------------------------- real commands

API_KEY = "sk-live-0123456789abcdefSECRET"
HF_TOKEN = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz"
KEYFILE = "/etc/ssl/private/server-secret.key"

SERVER_LIKE = """
import sys, time
print("ready", flush=True)
time.sleep(300)
"""


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vllm_mmcache_fix", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(REPO_ROOT),
        env={**os.environ, **(env or {})},
    )


def _diagnose_reports(children: Children, *serve_args: str) -> list[tuple[str, str]]:
    """``diagnose`` of a process started as ``vllm serve /models/m <serve_args>``, as text
    and as JSON: (its output, its one process' command line in --json or "")."""
    proc = children.start(SERVER_LIKE, "serve", "/models/m", *serve_args)
    assert read_line(proc) == "ready"
    reports = []
    for extra in ([], ["--json"]):
        done = _cli("diagnose", "--pid", str(proc.pid), "--interval", "0.5", *extra)
        out = done.stdout + done.stderr
        assert done.returncode == 0, out
        cmdline = json.loads(done.stdout)["processes"][0]["cmdline"] if extra else ""
        reports.append((out, cmdline))
    return reports


def test_diagnose_of_a_process_started_with_an_api_key(children: Children) -> None:
    reports = _diagnose_reports(
        children,
        "--api-key",
        API_KEY,
        f"--hf-token={HF_TOKEN}",
        "--ssl-keyfile",
        KEYFILE,
        "--port",
        "8000",
    )
    for out, _ in reports:
        for secret in (API_KEY, HF_TOKEN, KEYFILE):
            assert secret not in out, (secret, out)
    cmdline = reports[1][1]
    assert f"--api-key {REDACTED}" in cmdline, cmdline
    assert f"--hf-token={REDACTED}" in cmdline
    assert cmdline.endswith("--port 8000")


def test_check_hides_secret_named_settings() -> None:
    secret = "Zq9-very-secret-value"
    env = {"MMCACHE_FIX_API_TOKEN": secret}
    for extra in ([], ["--json"]):
        done = _cli("check", *extra, env=env)
        out = done.stdout + done.stderr
        assert secret not in out, out
        assert "MMCACHE_FIX_API_TOKEN" in out  # still reported as an unknown setting


def test_status_hides_a_password_in_its_url() -> None:
    done = _cli("status", "--url", "http://ops:Zq9pass@127.0.0.1:9/", "--timeout", "2", "--json")
    assert "Zq9pass" not in done.stdout + done.stderr, done.stdout
    assert json.loads(done.stdout)["verdict"] == "unreachable"


def test_diagnose_of_a_process_with_secrets_in_json_and_several_api_keys(
    children: Children,
) -> None:
    config = '{"kv_connector_extra_config": {"api_key": "Zq9-nested-secret", "port": 5}}'
    reports = _diagnose_reports(
        children,
        "--kv-transfer-config",
        config,
        "--api-key",
        "Zq9-first-key",
        "Zq9-second-key",
        "--port",
        "8000",
    )
    for out, _ in reports:
        assert "Zq9" not in out, out
    cmdline = reports[1][1]
    assert f"--api-key {REDACTED} {REDACTED} --port 8000" in cmdline
    assert '"port": 5' in cmdline
