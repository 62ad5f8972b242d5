"""Command line: ``vllm-mmcache-fix check | diagnose | patch``.

The only module that prints.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Sequence

EXIT_USAGE = 2


def _print_check(report: object, as_json: bool) -> None:
    from .check import CheckReport

    assert isinstance(report, CheckReport)
    if as_json:
        print(json.dumps(report.as_dict(), indent=2, sort_keys=True))
        return
    if report.vllm_version is None:
        for remedy in report.remedies:
            print(f"remedy: {remedy}")
        print(f"verdict: {report.verdict.value.upper()} - {report.summary}")
        return
    rows = [
        ("vLLM", f"{report.vllm_version or '-'} ({report.vllm_location or '-'})"),
        ("vllm-ascend", report.vllm_ascend_version or "not installed"),
        ("cachetools", report.cachetools_version or "-"),
    ]
    if report.exposure:
        rows.append(
            (
                "vLLM LRUCache",
                f"touch adds ghost keys: {_yn(report.exposure['touch_creates_ghost'])}; "
                f"eviction stalls on a ghost: {_yn(report.exposure['eviction_stalls_on_ghost'])}",
            )
        )
    rows += [
        ("plugin entry point", "found" if report.entry_point_found else "NOT found"),
        (
            "VLLM_PLUGINS",
            f"{'unset' if report.vllm_plugins is None else repr(report.vllm_plugins)} -> "
            f"mmcache_fix {'loads' if report.plugin_allowed else 'does NOT load'}",
        ),
    ]
    if report.ascend_allowed is not None:
        rows.append(("ascend platform", "loads" if report.ascend_allowed else "FILTERED OUT"))
    rows += [
        ("MMCACHE_FIX_MODE", report.mode),
        ("patch on this layout", _patch_text(report.patch_works, report.target)),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    for problem in report.problems:
        print(f"problem: {problem}")
    for remedy in report.remedies:
        print(f"remedy: {remedy}")
    print(f"verdict: {report.verdict.value.upper()} - {report.summary}")


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
        report = run_check()
    _print_check(report, args.json)
    return report.exit_code


def cmd_diagnose(args: argparse.Namespace) -> int:
    from . import diagnose

    try:
        result = diagnose.diagnose(args.pid, interval=args.interval, use_py_spy=not args.no_py_spy)
    except diagnose.DiagnoseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return diagnose.EXIT_ERROR
    if args.json:
        print(json.dumps(result.as_dict(), indent=2, sort_keys=True))
    else:
        print(diagnose.render(result))
    return diagnose.exit_code(result)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-mmcache-fix",
        description="Check and diagnose the vLLM multimodal cache freeze.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check",
        help="is this environment protected? (exit 0 protected/not affected, 1 vulnerable)",
    )
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.set_defaults(func=cmd_check)
    diag = sub.add_parser("diagnose", help="is a live vLLM process frozen in the cache?")
    diag.add_argument("--pid", type=int, required=True, help="API server or EngineCore PID")
    diag.add_argument("--interval", type=float, default=2.0, help="sampling seconds")
    diag.add_argument("--no-py-spy", action="store_true", help="skip the stack dump")
    diag.add_argument("--json", action="store_true", help="machine-readable output")
    diag.set_defaults(func=cmd_diagnose)
    # Parsed by source_patch itself (see main); listed here for --help.
    sub.add_parser(
        "patch",
        help="apply/check/revert the source patch on the installed vLLM, for images "
        "where plugins are filtered out (`patch --help` for its options)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["patch"]:
        from . import source_patch

        return source_patch.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
