"""Command line: ``vllm-mmcache-fix check | diagnose | patch``.

The only module of the package that prints; ``check``, ``diagnose`` and
``source_patch`` compute and return values.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from ..core.messages import PREFIX

EXIT_USAGE = 2


def _print_check(report: object, as_json: bool) -> None:
    from .check import CheckReport

    assert isinstance(report, CheckReport)
    if as_json:
        print(json.dumps(report.as_dict(), indent=2, sort_keys=True))
        return
    if report.vllm_version is None:
        _print_filtered(report.filtered_out)
        for problem in report.problems:
            print(f"problem: {problem}")
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
    _print_filtered(report.filtered_out)
    for problem in report.problems:
        print(f"problem: {problem}")
    for remedy in report.remedies:
        print(f"remedy: {remedy}")
    print(f"verdict: {report.verdict.value.upper()} - {report.summary}")


def _print_filtered(filtered: list[dict[str, object]]) -> None:
    for ep in filtered:
        flag = "  <- vllm-ascend" if ep["vllm_ascend"] else ""
        print(
            f"filtered out: {ep['group']} {ep['name']} = {ep['value']} "
            f"(distribution {ep['distribution']}){flag}"
        )


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


def cmd_patch(args: argparse.Namespace) -> int:
    from . import source_patch as sp

    try:
        if args.check:
            outcome = sp.inspect_tree(
                args.root, patches_dir=args.patches_dir, version=args.vllm_version
            )
        elif args.revert:
            outcome = sp.revert(
                args.root, patches_dir=args.patches_dir, version=args.vllm_version, tool=args.tool
            )
        else:
            outcome = sp.apply(
                args.root, patches_dir=args.patches_dir, version=args.vllm_version, tool=args.tool
            )
    except (OSError, ValueError, KeyError) as exc:
        outcome = sp.Outcome(sp.EXIT_ERROR, f"{type(exc).__name__}: {exc}")
    if args.json:
        print(json.dumps(outcome.as_dict(), indent=2))
    else:
        ok = outcome.exit_code in (sp.EXIT_OK, sp.EXIT_NOT_APPLIED)
        stream = sys.stdout if ok else sys.stderr
        print(f"{PREFIX}{outcome.message}", file=stream)
        for line in outcome.details:
            print(f"  {line}", file=stream)
    return outcome.exit_code


def add_patch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="directory containing vllm/ (a site-packages dir or a vLLM checkout); "
        "default: where the installed vllm package is",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="only report; change nothing")
    mode.add_argument("--revert", action="store_true", help="undo the patch")
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
    parser.add_argument("--json", action="store_true", help="print the outcome as JSON")


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
    patch = sub.add_parser(
        "patch",
        help="apply/check/revert the source patch on the installed vLLM, for images "
        "where plugins are filtered out",
        description="Apply the vllm-mmcache-fix source patch to a vLLM tree "
        "(for images that cannot load vLLM plugins).",
    )
    add_patch_arguments(patch)
    patch.set_defaults(func=cmd_patch)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
