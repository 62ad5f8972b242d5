"""One exit-code table for every command, and the envelope of every ``--json`` output.

Each exit code means one thing whatever the command; each verdict a command can
print maps to one code. 2 is argparse's usage error and nothing else. The README's
table is rendered from :data:`CODES` (``tests/unit/test_cli_convention.py`` keeps the
two in step).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any

from .. import __version__

JSON_SCHEMA_VERSION = 2
"""Version of every ``--json`` output's layout (1: the 0.2 tools, each its own)."""


@dataclass(frozen=True)
class Code:
    code: int
    name: str
    meaning: str
    commands: tuple[str, ...]


OK = Code(0, "ok", "protected, done, or nothing wrong seen", ("all",))
ERROR = Code(
    1,
    "error",
    "the command itself failed (an unreadable file, an unexpected error); the message says why",
    ("all",),
)
USAGE = Code(2, "usage", "bad command line", ("all",))
UNPROTECTED = Code(
    3,
    "unprotected",
    "vLLM's multimodal caches can freeze: the plugin is not installed (or not loaded by "
    "this server) and vLLM is not source-patched",
    ("check", "patch", "status"),
)
INACTIVE = Code(
    4,
    "inactive",
    "the plugin is installed but does not protect: VLLM_PLUGINS leaves it out, "
    "MMCACHE_FIX_MODE is off or warn, or it does not know this vLLM's layout",
    ("check", "status"),
)
NO_VLLM = Code(
    5, "no_vllm", "no vLLM in this Python environment (or under --root)", ("check", "patch")
)
VLLM_IMPORT_FAILED = Code(
    6,
    "vllm_import_failed",
    "vLLM is installed but `import vllm` fails (the exception is reported): a server would "
    "not start either",
    ("check",),
)
PATCH_REFUSED = Code(
    7,
    "patch_refused",
    "the source patch was not applied: the file is not as released, this release has no "
    "patch, or the file is reached through a symlink; nothing was changed",
    ("patch",),
)
PATCH_FAILED = Code(
    8, "patch_failed", "applying or reverting failed; the file was left as it was", ("patch",)
)
STUCK = Code(
    9,
    "stuck",
    "the server answers but an EngineCore does not: restart the server",
    ("status",),
)
UNREACHABLE = Code(10, "unreachable", "the server's /metrics could not be read", ("status",))
SPINNING_IN_MM_CACHE = Code(
    11,
    "spinning_in_mm_cache",
    "a thread spins in the multimodal cache's eviction loop (the freeze this plugin prevents)",
    ("diagnose",),
)
SPINNING = Code(
    12,
    "spinning",
    "an EngineCore thread (not its busy loop) spins without blocking, stack not checked: "
    "the freeze's signature (a Worker's or API server's busy thread is not)",
    ("diagnose",),
)
SPINNING_ELSEWHERE = Code(
    13,
    "spinning_elsewhere",
    "an EngineCore thread spins, its stack not in the multimodal cache nor in vLLM's busy-waits",
    ("diagnose",),
)
BLOCKED = Code(
    14, "blocked", "threads stopped or in uninterruptible sleep all the time", ("diagnose",)
)
EXITED = Code(15, "exited", "the process exited while it was sampled", ("diagnose",))
ENGINE_INPUT_THREAD_GONE = Code(
    16,
    "engine_input_thread_gone",
    "EngineCore is idle because its input thread has died (vLLM 0.13 and older after a "
    "failed request): it will never read another request",
    ("diagnose",),
)

STRICT_FAILED = Code(
    17,
    "strict_failed",
    "`check --strict`: protected, but fault injection is on (`MMCACHE_FIX_FAIL_AT`), an "
    "`MMCACHE_FIX_*` value is bad or unknown, or `VLLM_PLUGINS` leaves out other installed "
    "plugins (without --strict: warnings, exit 0)",
    ("check",),
)

CODES: tuple[Code, ...] = (
    OK,
    ERROR,
    USAGE,
    UNPROTECTED,
    INACTIVE,
    NO_VLLM,
    VLLM_IMPORT_FAILED,
    PATCH_REFUSED,
    PATCH_FAILED,
    STUCK,
    UNREACHABLE,
    SPINNING_IN_MM_CACHE,
    SPINNING,
    SPINNING_ELSEWHERE,
    BLOCKED,
    EXITED,
    ENGINE_INPUT_THREAD_GONE,
    STRICT_FAILED,
)

_BY_NUMBER = {c.code: c for c in CODES}


class Verdict(str, enum.Enum):
    """Every verdict any command prints, with its exit status: ``code`` is its :class:`Code`.

    One vocabulary for every command (``check``, ``patch``, ``status`` and ``diagnose``
    each print some of these), so that a verdict means one thing and has one code
    wherever it is printed. ``str()`` is the verdict's name, as ``--json`` prints it."""

    _value_: str
    code: Code

    def __new__(cls, value: str, exit_status: int) -> Verdict:
        member = str.__new__(cls, value)
        member._value_ = value
        member.code = _BY_NUMBER[exit_status]
        return member

    def __str__(self) -> str:
        return str.__str__(self)

    # check
    PROTECTED = "protected", 0
    PROTECTED_SOURCE_PATCH = "protected_source_patch", 0
    UNPROTECTED = "unprotected", 3
    INACTIVE = "inactive", 4
    NO_VLLM = "no_vllm", 5
    VLLM_IMPORT_FAILED = "vllm_import_failed", 6
    STRICT_FAILED = "strict_failed", 17
    """``check --strict`` only: protected, but with something a production image must not
    carry (see ``CheckReport.strict_problems``)."""
    # patch (no_vllm as above)
    APPLIED = "applied", 0
    """``check``: the fix is in the file; ``apply``: done now or before."""
    REVERTED = "reverted", 0
    NOT_NEEDED = "not_needed", 0
    """``check``: the file is unpatched, but the installed plugin protects this vLLM."""
    UNPATCHED = "unpatched", 3
    """``check``: the file is unpatched and nothing else protects this vLLM."""
    PATCH_REFUSED = "patch_refused", 7
    PATCH_FAILED = "patch_failed", 8
    # status (protected / unprotected / inactive as above)
    STUCK = "stuck", 9
    UNREACHABLE = "unreachable", 10
    # diagnose (its order of severity: diagnose.rules.SEVERITY)
    IDLE = "idle", 0
    ACTIVE = "active", 0
    SPINNING_IN_MM_CACHE = "spinning_in_mm_cache", 11
    SPINNING = "spinning", 12
    SPINNING_ELSEWHERE = "spinning_elsewhere", 13
    BLOCKED = "blocked", 14
    EXITED = "exited", 15
    ENGINE_INPUT_THREAD_GONE = "engine_input_thread_gone", 16
    # every command
    ERROR = "error", 1
    USAGE = "usage", 2


VERDICTS: dict[str, Code] = {v.value: v.code for v in Verdict}
"""Every verdict any command prints, by name, with its exit code."""


def exit_code(verdict: str) -> int:
    return VERDICTS[verdict].code


def envelope(command: str, verdict: str, data: dict[str, Any] | None = None) -> dict[str, Any]:
    """What every ``--json`` output carries, then the command's own fields."""
    out: dict[str, Any] = {
        "schema_version": JSON_SCHEMA_VERSION,
        "tool_version": __version__,
        "command": command,
        "verdict": verdict,
        "exit_code": exit_code(verdict),
    }
    for key, value in (data or {}).items():
        out.setdefault(key, value)
    return out


def record_envelope(command: str, record: Any, **values: Any) -> dict[str, Any]:
    """:func:`envelope` of a dataclass with a ``verdict`` enum: its other fields in their
    order, those named in ``values`` given as there."""
    data = {f.name: getattr(record, f.name) for f in fields(record) if f.name != "verdict"}
    data.update(values)
    return envelope(command, record.verdict.value, data)


def markdown_table() -> str:
    """The README's exit-code table."""
    by_code: dict[int, list[str]] = {}
    for verdict, code in VERDICTS.items():
        if verdict not in ("error", "usage"):
            by_code.setdefault(code.code, []).append(f"`{verdict}`")
    lines = ["| exit | verdicts | meaning | commands |", "|---|---|---|---|"]
    for code in CODES:
        verdicts = ", ".join(by_code.get(code.code, [f"`{code.name}`"]))
        lines.append(f"| {code.code} | {verdicts} | {code.meaning} | {', '.join(code.commands)} |")
    return "\n".join(lines)
