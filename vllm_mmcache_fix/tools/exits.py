"""One exit-code table for every command, and the envelope of every ``--json`` output.

Each exit code means one thing whatever the command; each verdict a command can
print maps to one code. 2 is argparse's usage error and nothing else. The README's
table is rendered from :data:`CODES` (``tests/unit/test_cli_convention.py`` keeps the
two in step).
"""

from __future__ import annotations

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

VERDICTS: dict[str, Code] = {
    # check
    "protected": OK,
    "protected_source_patch": OK,
    "unprotected": UNPROTECTED,
    "inactive": INACTIVE,
    "no_vllm": NO_VLLM,
    "vllm_import_failed": VLLM_IMPORT_FAILED,
    "strict_failed": STRICT_FAILED,
    # patch
    "applied": OK,
    "reverted": OK,
    "not_needed": OK,
    "unpatched": UNPROTECTED,
    "patch_refused": PATCH_REFUSED,
    "patch_failed": PATCH_FAILED,
    # status (protected / unprotected / inactive as above)
    "stuck": STUCK,
    "unreachable": UNREACHABLE,
    # diagnose
    "idle": OK,
    "active": OK,
    "spinning_in_mm_cache": SPINNING_IN_MM_CACHE,
    "spinning": SPINNING,
    "spinning_elsewhere": SPINNING_ELSEWHERE,
    "blocked": BLOCKED,
    "exited": EXITED,
    "engine_input_thread_gone": ENGINE_INPUT_THREAD_GONE,
    # every command
    "error": ERROR,
    "usage": USAGE,
}
"""Every verdict any command prints, with its exit code."""


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
