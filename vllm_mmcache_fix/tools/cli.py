"""Command line: ``vllm-mmcache-fix check | status | diagnose | patch``.

The only module of the package that prints; ``check``, ``status``, ``diagnose`` and
``source_patch`` compute and return values. One convention for all of them:

- exit codes from one table (``exits.py``; 2 is a usage error and nothing else);
- ``--json`` prints one JSON object on stdout, errors included, with ``schema_version``,
  ``tool_version``, ``command``, ``verdict`` and ``exit_code``;
- verdicts are lower-case names (``protected``, ``spinning_in_mm_cache``);
- nothing is written unless the command says so (``patch apply``, ``patch revert``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from .. import __version__
from ..core.messages import PREFIX
from . import exits
from .diagnose.rules import MIN_INTERVAL
from .redact import redact_data, redact_text

COMMANDS = ("check", "status", "diagnose", "patch")


def _print_json(data: dict[str, Any]) -> None:
    print(json.dumps(redact_data(data), indent=2, sort_keys=True, default=str))


class _RedactingStream:
    """stdout or stderr with secrets taken out of every line (tools/redact.py): whatever a
    command prints, a report is safe to attach to a ticket."""

    def __init__(self, target: Any) -> None:
        self._target = target
        self._pending = ""

    def write(self, text: str) -> int:
        self._pending += text
        if "\n" in self._pending:
            lines, _, self._pending = self._pending.rpartition("\n")
            self._target.write(redact_text(lines + "\n"))
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self._target.write(redact_text(self._pending))
            self._pending = ""
        self._target.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


def _error(command: str, message: str, as_json: bool, **extra: Any) -> int:
    """An error of the command itself (exit 1), as text on stderr or as JSON on stdout."""
    if as_json:
        _print_json(exits.envelope(command, "error", {"error": message, **extra}))
    else:
        print(f"{PREFIX}{command}: error: {message}", file=sys.stderr)
    return exits.ERROR.code


# --------------------------------------------------------------------------- check


def _print_check(report: Any) -> None:
    rows = [("vllm-mmcache-fix", _plugin_text(report))]
    if report.vllm_import_error:
        rows.append(("vLLM", f"{report.vllm_version or '?'} ({report.vllm_location or '-'})"))
        rows.append(("import vllm", f"FAILS: {report.vllm_import_error}"))
    elif report.vllm_version is not None:
        rows.append(("vLLM", f"{report.vllm_version} ({report.vllm_location or '-'})"))
        rows.append(("verified up to", report.verified_up_to))
    else:
        rows.append(("vLLM", "not installed"))
    rows.append(("vllm-ascend", report.vllm_ascend_version or "not installed"))
    if report.cachetools_version:
        rows.append(("cachetools", report.cachetools_version))
    if report.exposure:
        rows.append(
            (
                "vLLM LRUCache",
                f"touch adds ghost keys: {_yn(report.exposure['touch_creates_ghost'])}; "
                f"eviction stalls on a ghost: {_yn(report.exposure['eviction_stalls_on_ghost'])}",
            )
        )
    rows.append(
        (
            "VLLM_PLUGINS",
            f"{'unset' if report.vllm_plugins is None else repr(report.vllm_plugins)} -> "
            f"mmcache_fix {'loads' if report.plugin_allowed else 'does NOT load'}",
        )
    )
    if report.ascend_allowed is not None:
        rows.append(("ascend platform", "loads" if report.ascend_allowed else "FILTERED OUT"))
    for setting in report.settings:
        value = setting["effective"]
        text = "unset" if setting["raw"] is None else repr(setting["raw"])
        if setting["known"]:
            text += f" -> {value if value != '' else '-'}"
        if setting["problem"]:
            text += "  <- BAD"
        rows.append((setting["name"], text))
    if report.vllm_version is not None and not report.vllm_import_error:
        rows.append(("plugin patch", _patch_text(report.patch_works, report.target)))
        rows.append(("source patch", _source_text(report)))
    rows.append(
        (
            "vLLM plugin entry points",
            f"{len(report.plugin_entry_points)} installed, "
            f"{len(report.filtered_out)} filtered out by VLLM_PLUGINS",
        )
    )
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    for ep in report.filtered_out:
        flag = "  <- vllm-ascend" if ep["vllm_ascend"] else ""
        print(
            f"filtered out: {ep['group']} {ep['name']} = {ep['value']} "
            f"(distribution {ep['distribution']}){flag}"
        )
    for line in report.vllm_import_traceback:
        print(f"  | {line}")
    strict = set(report.strict_problems)
    for problem in report.problems:
        tag = "problem" if report.strict or problem not in strict else "warning"
        print(f"{tag}: {problem}")
    for finding in report.findings:
        print(f"cause: {finding.cause.value}: {finding.detail}")
        print(f"remedy: {finding.remedy}")
    if not report.findings and report.remedy:
        print(f"remedy: {report.remedy}")
    from .sizing import sizing_lines

    for line in sizing_lines(report.sizing):
        print(line)
    print(f"verdict: {report.verdict.value} (exit {report.exit_code}) - {report.summary}")


def _plugin_text(report: Any) -> str:
    if report.plugin_version is None:
        return f"{report.tool_version} (this check); not installed for vLLM to load"
    if report.plugin_version == report.tool_version:
        return f"{report.tool_version} (installed, entry point found)"
    return f"{report.tool_version} (this check); vLLM would load {report.plugin_version}"


def _source_text(report: Any) -> str:
    state = (report.source_patch or {}).get("state")
    if report.source_patched:
        return f"applied ({(report.source_patch or {}).get('patch_file') or 'fixed class found'})"
    return state or "not applied"


def _yn(value: object) -> str:
    return "yes" if value else "no"


def _patch_text(works: bool | None, target: str | None) -> str:
    if works is None:
        return "not tried"
    return f"{'works' if works else 'FAILS'} ({target or 'target not found'})"


def cmd_check(args: argparse.Namespace) -> int:
    from .check import run_check

    # vLLM logs to stdout; keep stdout for the report (and valid --json).
    with contextlib.redirect_stdout(sys.stderr):
        report = run_check(serve_args=args.serve_args, strict=args.strict)
    if args.json:
        _print_json(exits.envelope("check", report.verdict.value, report.as_dict()))
    else:
        _print_check(report)
    return report.exit_code


# --------------------------------------------------------------------------- status


def cmd_status(args: argparse.Namespace) -> int:
    from .status import read_status

    report = read_status(args.url, timeout=args.timeout, stuck_after=args.stuck_after)
    if args.json:
        _print_json(report.as_dict())
        return report.exit_code
    print(f"server            {report.url}")
    if report.plugin_version or report.vllm_version:
        print(f"vllm-mmcache-fix  {report.plugin_version or '?'} on vLLM {report.vllm_version}")
    if report.health_status is not None or report.health_error:
        print(f"/health           {report.health_status or report.health_error}")
    for kind, count in sorted(report.protected.items()):
        print(f"protected         {kind}: {count:g}")
    for engine, data in sorted(report.engines.items()):
        parts = [f"stuck /health checks {data['round_trips_failed_after']:g}"]
        if data["last_answer_age_s"] is not None:
            parts.append(f"last answer {data['last_answer_age_s']:.1f} s ago")
        print(f"engine            {engine}: {', '.join(parts)}")
    for name, value in sorted(report.counters.items()):
        print(f"{name}  {value:g}")
    for cache, fig in sorted(report.caches.items()):
        parts = []
        if "occupancy" in fig:
            used, capacity = fig["bytes"], fig["capacity_bytes"]
            parts.append(f"{fig['occupancy']:.0%} full ({used:.0f} of {capacity:.0f} bytes)")
        if "entries" in fig:
            parts.append(f"{fig['entries']:g} entries")
        if "evictions" in fig:
            rate = fig.get("evictions_per_min")
            parts.append(
                f"{fig['evictions']:g} evictions"
                + (f" ({rate:.0f}/min just now)" if rate is not None else "")
            )
        for modality, rate in sorted(fig["hit_rate"].items()):
            if rate is not None:
                parts.append(f"{modality} hit rate {rate:.0%} of {fig['lookups'][modality]:g}")
        if fig.get("too_large"):
            parts.append(f"{fig['too_large']:g} items too large")
        print(f"mm cache          {cache}: {', '.join(parts)}")
    if report.remedy:
        print(f"remedy: {report.remedy}")
    print(f"verdict: {report.verdict.value} (exit {report.exit_code}) - {report.summary}")
    return report.exit_code


# --------------------------------------------------------------------------- patch


def cmd_patch(args: argparse.Namespace) -> int:
    from . import source_patch as sp

    action = args.action
    try:
        if action == "check":
            outcome = sp.inspect_tree(
                args.root,
                patches_dir=args.patches_dir,
                version=args.vllm_version,
                plugin_protects=_plugin_protects(args.root),
            )
        else:
            outcome = sp.apply(
                args.root,
                patches_dir=args.patches_dir,
                version=args.vllm_version,
                tool=args.tool,
                follow_symlinks=args.follow_symlinks,
                reverse=action == "revert",
            )
    except (OSError, ValueError, KeyError) as exc:
        outcome = sp.Outcome(sp.Verdict.ERROR, f"{type(exc).__name__}: {exc}")
    if args.json:
        _print_json(outcome.as_dict())
    else:
        ok = outcome.exit_code in (sp.EXIT_OK, sp.EXIT_NOT_APPLIED)
        stream = sys.stdout if ok else sys.stderr
        print(f"{PREFIX}{outcome.message}", file=stream)
        for line in outcome.details:
            print(f"  {line}", file=stream)
        print(f"verdict: {outcome.verdict.value} (exit {outcome.exit_code})", file=stream)
    return outcome.exit_code


def _plugin_protects(root: Path | None) -> str | None:
    """Why the plugin installed next to this Python protects the vLLM at ``root``, from
    metadata and settings only (``patch`` never imports vLLM); None when it does not, or
    when ``root`` is another environment's vLLM (this Python's metadata says nothing
    about that one)."""
    import os

    from .check import plugin_loads
    from .source_patch import find_vllm_root

    if root is not None:
        own = find_vllm_root()
        if own is None or os.path.abspath(own) != os.path.abspath(root):
            return None
    return plugin_loads()


def add_patch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action",
        nargs="?",
        choices=("check", "apply", "revert"),
        default="check",
        help="check (default): report only; apply: patch vLLM's file; revert: undo it",
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="directory containing vllm/ (a site-packages dir or a vLLM checkout); "
        "default: where the installed vllm package is",
    )
    parser.add_argument(
        "--patches-dir", type=Path, default=None, help="directory with index.json and the diffs"
    )
    parser.add_argument(
        "--vllm-version", default=None, help="use this version instead of reading the tree's"
    )
    parser.add_argument(
        "--tool",
        choices=("auto", "patch", "python"),
        default="auto",
        help="apply with patch(1) or the built-in applier (auto: patch if installed)",
    )
    parser.add_argument(
        "--follow-symlinks",
        action="store_true",
        help="when vLLM's file is a symlink (Nix, Bazel), change the file it points to "
        "(default: refuse)",
    )
    parser.add_argument("--json", action="store_true", help="print the outcome as JSON")


# --------------------------------------------------------------------------- diagnose


def cmd_diagnose(args: argparse.Namespace) -> int:
    from . import diagnose
    from .diagnose import snapshot

    if args.pid is None and args.snapshot is None:
        args.usage_error("the following arguments are required: --pid (or --snapshot FILE)")
    shown: tuple[Path, dict[str, Any]] | None = None
    if args.snapshot is not None:
        try:
            shown = (args.snapshot, snapshot.load_snapshot(args.snapshot))
        except snapshot.SnapshotError as exc:
            return _error("diagnose", str(exc), args.json, pid=args.pid)
    if args.pid is None:
        assert shown is not None
        if args.json:
            _print_json({"stall_snapshot": {"path": str(shown[0]), **shown[1]}})
        else:
            print(snapshot.render_snapshot(shown[1], shown[0]))
        return 0
    try:
        result = diagnose.diagnose(args.pid, interval=args.interval, use_py_spy=not args.no_py_spy)
    except diagnose.DiagnoseError as exc:
        return _error("diagnose", str(exc), args.json, pid=args.pid)
    note = None
    if shown is None:
        # The newest stall snapshot an API server of this process tree wrote since it
        # started, if any; one that cannot be read is a note, the diagnosis stands.
        found = snapshot.find_snapshot([args.pid, *(p.pid for p in result.processes)])
        if found is not None:
            try:
                shown = (found, snapshot.load_snapshot(found))
            except snapshot.SnapshotError as exc:
                note = f"stall snapshot not shown: {exc}"
    if args.json:
        out = result.as_dict()
        if shown is not None:
            out["stall_snapshot"] = {"path": str(shown[0]), **shown[1]}
        if note is not None:
            out["stall_snapshot_error"] = note
        _print_json(out)
    else:
        print(diagnose.render(result))
        if shown is not None:
            print()
            print(snapshot.render_snapshot(shown[1], shown[0]))
        if note is not None:
            print()
            print(note)
    return diagnose.exit_code(result)


# --------------------------------------------------------------------------- argument types


def _seconds(minimum: float, maximum: float | None = None) -> Any:
    """An argparse type: a finite number of seconds > ``minimum`` (>= when ``minimum`` is
    above 0), at most ``maximum``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r}: give a finite number of seconds")
        if value <= 0 or value < minimum:
            floor = f"at least {minimum:g}" if minimum > 0 else "more than 0"
            raise argparse.ArgumentTypeError(f"{text!r}: give {floor} seconds")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{text!r}: give at most {maximum:g} seconds")
        return value

    return parse


def _pid(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a process ID") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a process ID is a number from 1 up")
    return value


def _url(text: str) -> str:
    from .status import normalize_url

    try:
        return normalize_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


MAX_INTERVAL_S = 600.0
"""The longest ``diagnose --interval``: a diagnosis is taken while the server is frozen."""

# --------------------------------------------------------------------------- parser


class _Parser(argparse.ArgumentParser):
    """A usage error is exit 2, and with ``--json`` anywhere on the line it is JSON too."""

    json_requested = False
    command = ""

    def error(self, message: str) -> NoReturn:
        if _Parser.json_requested:
            command = _Parser.command
            _print_json(
                exits.envelope(
                    command or "", "usage", {"error": message, "usage": self.format_usage()}
                )
            )
            self.exit(exits.USAGE.code)
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="vllm-mmcache-fix",
        description="Check, watch and diagnose the vLLM multimodal cache freeze. Exit codes "
        "are one table for every command (README: Exit codes).",
    )
    parser.add_argument("--version", action="version", version=f"vllm-mmcache-fix {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    check = sub.add_parser(
        "check",
        help="would a vLLM server started from this environment be protected? (exit 0: protected)",
    )
    check.add_argument(
        "--strict",
        action="store_true",
        help="also fail (exit 17, strict_failed) on what is otherwise a warning: fault "
        "injection on (MMCACHE_FIX_FAIL_AT), a bad or unknown MMCACHE_FIX_* value, a "
        "VLLM_PLUGINS that leaves out other installed plugins; for image builds to gate on",
    )
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.add_argument(
        "--serve-args",
        metavar="CMDLINE",
        help="the server's `vllm serve ...` command line: the multimodal caches' memory at "
        "full against the container's limit and the host's RAM",
    )
    check.set_defaults(func=cmd_check)

    status = sub.add_parser(
        "status",
        help="is a running server protected, and is it stuck? (reads its /metrics)",
    )
    status.add_argument(
        "--url",
        required=True,
        type=_url,
        help="the server's base URL, e.g. http://host:8000 (host:port means http://host:port; "
        "a path of / or /v1, the OpenAI base URL, is dropped: /metrics and /health are read "
        "at the root; any other path, a query or a fragment is a usage error; "
        "http://user:password@host:8000 sends HTTP Basic auth)",
    )
    status.add_argument(
        "--timeout",
        type=_seconds(0.0),
        default=15.0,
        help="seconds for each whole HTTP request (connecting, the answer and its body), "
        "more than 0 (default 15)",
    )
    status.add_argument(
        "--stuck-after",
        type=_seconds(0.0),
        default=30.0,
        help="an engine whose last answer is older than this many seconds is stuck "
        "(read where the server exports its age; default 30)",
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=cmd_status)

    diag = sub.add_parser("diagnose", help="is a live vLLM process frozen? (reads /proc)")
    diag.add_argument("--pid", type=_pid, help="API server or EngineCore PID")
    diag.add_argument(
        "--snapshot",
        type=Path,
        help="a stall snapshot file the API server wrote at a /health verdict (shown; with "
        "--pid, else the newest one the process tree wrote since it started, found in "
        "MMCACHE_FIX_SNAPSHOT_DIR)",
    )
    diag.add_argument(
        "--interval",
        type=_seconds(MIN_INTERVAL, MAX_INTERVAL_S),
        default=2.0,
        help=f"sampling seconds, {MIN_INTERVAL:g} to {MAX_INTERVAL_S:g} (default 2)",
    )
    diag.add_argument("--no-py-spy", action="store_true", help="skip the stack dumps")
    diag.add_argument("--json", action="store_true", help="machine-readable output")
    diag.set_defaults(func=cmd_diagnose, usage_error=diag.error)

    patch = sub.add_parser(
        "patch",
        help="check, apply or revert the source patch on vLLM's files, for images where "
        "plugins cannot load (writes only with apply or revert)",
        description="The vllm-mmcache-fix source patch on a vLLM tree, for images that "
        "cannot load vLLM plugins. `patch` alone (or `patch check`) changes nothing.",
    )
    add_patch_arguments(patch)
    patch.set_defaults(func=cmd_patch)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _Parser.json_requested = "--json" in argv
    _Parser.command = next((a for a in argv if a in COMMANDS), "")
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _RedactingStream(out), _RedactingStream(err)
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        try:
            return int(args.func(args))
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # a bug in the tool: still one answer, still the table's code
            return _error(
                args.command, f"{type(exc).__name__}: {exc}", bool(getattr(args, "json", False))
            )
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        sys.stdout, sys.stderr = out, err


if __name__ == "__main__":
    sys.exit(main())
