"""Secrets out of what the operator tools print or write.

``diagnose`` shows the server's command line, ``check`` the environment's settings, and
any of them may quote an error message: a report is meant to be attached to a ticket,
so it must not carry the server's API key or tokens. Redacted are the values of

- ``--api-key``, ``--hf-token``, ``--ssl-keyfile`` and any other option whose name
  contains ``token``, ``secret``, ``key`` or ``password`` (any case), written
  ``--name value`` or ``--name=value``; ``--api-key`` takes several values (vLLM's
  ``nargs='+'``): every word after it up to the next option;
- environment variables (``NAME=value``) and mapping keys (``"name": value``, a JSON
  field, or ``'name': value`` in a dict's repr) whose name contains one of those words,
  at any depth: a mapping inside an option's JSON value (``--kv-transfer-config
  '{"extra": {"api_key": "..."}}'``) is read key by key; a list under such a key has
  each of its items redacted;
- an HTTP ``Authorization: Bearer ...`` credential and the password of a URL
  (``http://user:password@host``; the password ends at the last ``@`` before the host).

Each value becomes :data:`REDACTED`; the names stay, so the report still says that the
server was started with an API key. One module for every command: the CLI passes each
output through :func:`redact_text` (text) or :func:`redact_data` (``--json``), and
``diagnose`` redacts command lines argument by argument with :func:`redact_argv` before
joining them (a value with spaces stays one value).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

REDACTED = "<redacted>"

SENSITIVE_OPTIONS = frozenset({"--api-key", "--hf-token", "--ssl-keyfile"})
"""Options redacted by name; the words below catch them too, listed for the reader."""
MULTI_VALUE_OPTIONS = frozenset({"--api-key"})
"""Sensitive options that take several values (vLLM's ``--api-key K1 K2``): every argument
after one, up to the next option, is a secret."""

_SENSITIVE_WORDS = re.compile(r"token|secret|key|password", re.IGNORECASE)

# An option and its value, in one string: --name=value or --name value.
_OPTION = re.compile(
    r"(?P<flag>(?<![\w-])--?[A-Za-z][\w.-]*)(?P<sep>=|[ \t]+)(?!-[A-Za-z-])"
    r"(?P<value>\"[^\"]*\"|'[^']*'|[^\s\"',;)\]}]+)"
)
# NAME=value (environment variables, key=value pairs, keyword arguments in a repr).
_ASSIGN = re.compile(
    r"(?P<name>(?<![\w-])[A-Za-z_][\w.-]*)(?P<sep>=)"
    r"(?P<value>\"[^\"]*\"|'[^']*'|[^\s\"',;)\]}]+)"
)
# "name": value / 'name': 'value' (JSON or a dict's repr inside a message). A value that
# opens a mapping or a list is not one value: a mapping's keys are matched one by one
# (the value of "config": {"api_key": ...} is not the text up to the next comma), a
# list's items by _LIST_ITEM.
_MAPPING = re.compile(
    r"(?P<name>\"[^\"]*\"|'[^']*')(?P<sep>\s*:\s*)"
    r"(?P<value>\"[^\"]*\"|'[^']*'|\[[^\[\]{}]*\]|[^\s,;)\]}{\[][^\s,;)\]}]*)"
)
# One item of a flat list: a quoted string or a bare word.
_LIST_ITEM = re.compile(r"\"[^\"]*\"|'[^']*'|[^\s,\[\]]+")
# Every word after a multi-value option (--api-key K1 K2), up to the next option.
_MULTI_VALUE = re.compile(
    r"(?P<flag>(?<![\w-])(?:"
    + "|".join(re.escape(o) for o in sorted(MULTI_VALUE_OPTIONS))
    + r"))(?P<values>(?:[ \t]+(?!-[A-Za-z-])[^\s]+)+)"
)
# user:password@host: the password runs to the last "@" before the host (p@ss@host).
_URL_PASSWORD = re.compile(r"(?P<head>://[^/\s:@]+:)(?P<value>[^/\s?#\"]+)(?P<at>@)")
_BEARER = re.compile(r"(?P<name>\bBearer)(?P<sep>\s+)(?P<value>[^\s\"',;)\]}]+)", re.IGNORECASE)


def is_sensitive(name: str) -> bool:
    """Whether an option, variable or field called ``name`` holds a secret."""
    bare = name.strip().strip("\"'").split("=", 1)[0]
    return bare in SENSITIVE_OPTIONS or bool(_SENSITIVE_WORDS.search(bare))


def _value(value: str) -> str:
    if value.startswith("[") and value.endswith("]"):
        return _LIST_ITEM.sub(lambda m: _value(m.group(0)), value)
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[0] + REDACTED + value[0]
    return REDACTED


def _redact_multi_values(match: re.Match[str]) -> str:
    words = re.split(r"([ \t]+)", match.group("values"))
    return match.group("flag") + "".join(
        part if not part or part.isspace() else REDACTED for part in words
    )


def _replace(pattern: re.Pattern[str], text: str, name_group: str, *, option: bool) -> str:
    def sub(match: re.Match[str]) -> str:
        name, sep, value = match.group(name_group), match.group("sep"), match.group("value")
        if not is_sensitive(name):
            return match.group(0)
        if option and sep != "=" and value.startswith("-") and not value[1:2].isdigit():
            return match.group(0)  # the next option, not this one's value
        if value.strip("\"'[]") == REDACTED:
            return match.group(0)
        return f"{name}{sep}{_value(value)}"

    return pattern.sub(sub, text)


def redact_text(text: str) -> str:
    """``text`` with every secret value (see the module docstring) replaced."""
    if not text:
        return text
    text = _replace(_OPTION, text, "flag", option=True)
    text = _MULTI_VALUE.sub(_redact_multi_values, text)
    text = _replace(_ASSIGN, text, "name", option=False)
    text = _replace(_MAPPING, text, "name", option=False)
    text = _URL_PASSWORD.sub(
        lambda m: (
            m.group(0)
            if m.group("value") == REDACTED
            else f"{m.group('head')}{REDACTED}{m.group('at')}"
        ),
        text,
    )
    return _BEARER.sub(lambda m: f"{m.group('name')}{m.group('sep')}{REDACTED}", text)


def redact_argv(argv: Sequence[str]) -> list[str]:
    """A command line, argument by argument: the value after a sensitive option (or in
    ``--name=value``) and ``NAME=value`` words of sensitive names are replaced."""
    out: list[str] = []
    hide_next = False
    hide_all = False  # after a multi-value option: every argument up to the next option
    for arg in argv:
        is_option = arg.startswith("-") and not arg[1:2].isdigit()
        if hide_next or hide_all:
            hide_next = False
            if not is_option:
                out.append(REDACTED)
                continue
            hide_all = False
        if is_option:
            name, eq, _ = arg.partition("=")
            if is_sensitive(name.lstrip("-")):
                if eq:
                    out.append(f"{name}={REDACTED}")  # argparse: one value after "="
                    continue
                hide_next = True
                hide_all = name in MULTI_VALUE_OPTIONS
                out.append(arg)
                continue
        elif "=" in arg:
            name = arg.split("=", 1)[0]
            if re.fullmatch(r"[A-Za-z_][\w.-]*", name) and is_sensitive(name):
                out.append(f"{name}={REDACTED}")
                continue
        out.append(redact_text(arg))
    return out


def redact_data(data: Any) -> Any:
    """A JSON-able structure with secrets replaced: values of sensitive keys (each item of
    a list, every value of a mapping), and every string through :func:`redact_text`."""
    if isinstance(data, dict):
        return {
            key: (
                _redact_whole(value)
                if isinstance(key, str) and is_sensitive(key)
                else redact_data(value)
            )
            for key, value in data.items()
        }
    if isinstance(data, (list, tuple)):
        return [redact_data(item) for item in data]
    if isinstance(data, str):
        return redact_text(data)
    return data


def _redact_whole(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float)):
        return value  # a flag or a count, not a secret
    if isinstance(value, (list, tuple)):
        return [_redact_whole(item) for item in value]
    if isinstance(value, dict):  # everything under a secret's name is the secret
        return {key: _redact_whole(item) for key, item in value.items()}
    return REDACTED
