"""The shared machinery every fix stands on: import hooks, the registry, the lifecycle, signals.

Each test runs the real ``core`` modules on throwaway modules and classes made here; the
fixes' own tests cover them on vLLM's classes.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from vllm_mmcache_fix.core import imports, registry, signals
from vllm_mmcache_fix.core.lifecycle import DidNotEnable, Fix


@pytest.fixture
def fresh_modules(tmp_path: Path) -> Iterator[Path]:
    """A folder on ``sys.path`` for modules the tests write; they are forgotten afterwards."""
    sys.path.insert(0, str(tmp_path))
    before = set(sys.modules)
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in set(sys.modules) - before:
            del sys.modules[name]
        imports.cancel_all()


def _write(folder: Path, name: str, body: str = "VALUE = 1\n") -> None:
    (folder / f"{name}.py").write_text(textwrap.dedent(body))


# --------------------------------------------------------------------------- imports


def test_a_module_already_imported_is_delivered_at_once(fresh_modules: Path) -> None:
    _write(fresh_modules, "mmfix_already")
    importlib.import_module("mmfix_already")
    seen: list[str] = []
    sub = imports.when_imported(["mmfix_already"], lambda name: seen.append(name) or True)
    assert seen == ["mmfix_already"]
    assert sub.done and sub not in imports.active()


def test_a_later_import_is_delivered_until_the_callback_is_done(fresh_modules: Path) -> None:
    _write(fresh_modules, "mmfix_first")
    _write(fresh_modules, "mmfix_second")
    seen: list[str] = []

    def callback(name: str) -> bool:
        seen.append(name)
        return name == "mmfix_second"

    sub = imports.when_imported(["mmfix_first", "mmfix_second"], callback)
    assert seen == [] and sub in imports.active()
    importlib.import_module("mmfix_first")
    assert seen == ["mmfix_first"] and not sub.done
    importlib.import_module("mmfix_second")
    assert seen == ["mmfix_first", "mmfix_second"] and sub.done
    assert imports.active() == []


def test_cancel_stops_delivery(fresh_modules: Path) -> None:
    _write(fresh_modules, "mmfix_cancelled")
    seen: list[str] = []
    sub = imports.when_imported(["mmfix_cancelled"], lambda name: seen.append(name) or False)
    imports.cancel(sub)
    importlib.import_module("mmfix_cancelled")
    assert seen == []


# --------------------------------------------------------------------------- registry


class Target:
    def method(self, first: int, *, flag: bool = False) -> int:
        """vLLM's docstring."""
        return first * 2

    @classmethod
    def factory(cls, capacity_gb: float, value_type: type) -> str:
        return f"{cls.__name__}:{capacity_gb}"

    @staticmethod
    def helper(x: int) -> int:
        return x + 1


def _calls_through(function: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return ("wrapped", function(*args, **kwargs))

    return wrapper


def test_wrap_keeps_vllm_s_signature_docstring_and_kind_and_reverts() -> None:
    before = {n: Target.__dict__[n] for n in ("method", "factory", "helper")}
    signatures = {n: inspect.signature(getattr(Target, n)) for n in before}
    try:
        for name in before:
            assert registry.wrap("test-wrap", Target, name, _calls_through)
            assert not registry.wrap("test-wrap", Target, name, _calls_through)  # once only
            assert registry.is_patched(Target, name)
            assert registry.get_original(Target, name) is before[name]
            assert inspect.signature(getattr(Target, name)) == signatures[name]
        assert Target.method.__doc__ == "vLLM's docstring."
        assert isinstance(Target.__dict__["factory"], classmethod)
        assert isinstance(Target.__dict__["helper"], staticmethod)
        assert Target().method(3) == ("wrapped", 6)
        assert Target.factory(0.5, object) == ("wrapped", "Target:0.5")
        assert Target.helper(1) == ("wrapped", 2)
    finally:
        registry.revert_patch("test-wrap")
    assert {n: Target.__dict__[n] for n in before} == before


def test_wrap_changes_nothing_when_the_maker_refuses() -> None:
    def refuse(function: Any) -> Any:
        raise TypeError("signature moved")

    with pytest.raises(TypeError):
        registry.wrap("test-refuse", Target, "method", refuse)
    assert not registry.is_patched(Target, "method")
    assert registry.revert_patch("test-refuse") == 0


def test_an_added_attribute_is_recorded_as_absent_and_deleted_on_revert() -> None:
    assert "mmfix_added" not in Target.__dict__
    assert registry.apply("test-add", Target, "mmfix_added", lambda self: "answer")
    assert Target().mmfix_added() == "answer"  # type: ignore[attr-defined]
    assert registry.get_original(Target, "mmfix_added") is registry.ABSENT
    assert registry.revert_patch("test-add") == 1
    assert "mmfix_added" not in Target.__dict__
    assert not hasattr(Target, "mmfix_added")


# --------------------------------------------------------------------------- lifecycle


def test_a_fix_waits_for_its_module_and_patches_once(fresh_modules: Path) -> None:
    _write(fresh_modules, "mmfix_target", "class Engine:\n    def step(self):\n        return 1\n")

    class Waiting(Fix):
        id = "test-waiting"
        runs_in = "every process"
        watches: ClassVar[tuple[str, ...]] = ("mmfix_target",)

        def __init__(self) -> None:
            super().__init__()
            self.tries: list[str] = []

        def _install(self) -> None:
            pass

        def _uninstall(self) -> None:
            registry.revert_patch(self.id)

        def _on_import(self, name: str) -> bool:
            self.tries.append(name)
            engine = sys.modules[name].Engine
            return registry.wrap(self.id, engine, "step", _calls_through)

    fix = Waiting()
    fix.install()
    assert fix.enabled and fix.waiting_for_import and fix.tries == []
    module = importlib.import_module("mmfix_target")
    assert fix.tries == ["mmfix_target"] and not fix.waiting_for_import
    assert module.Engine().step() == ("wrapped", 1)
    fix.install()  # idempotent
    assert fix.tries == ["mmfix_target"]
    fix.uninstall()
    assert module.Engine().step() == 1

    # Installed again with the module already imported: patched at once.
    fix.install()
    assert fix.tries == ["mmfix_target", "mmfix_target"] and not fix.waiting_for_import
    assert module.Engine().step() == ("wrapped", 1)
    fix.uninstall()


def test_an_error_while_patching_is_kept_and_never_raised(fresh_modules: Path) -> None:
    _write(fresh_modules, "mmfix_broken")
    importlib.import_module("mmfix_broken")

    class Broken(Fix):
        id = "test-broken"
        runs_in = "every process"
        watches: ClassVar[tuple[str, ...]] = ("mmfix_broken",)

        def _install(self) -> None:
            pass

        def _uninstall(self) -> None:
            pass

        def _on_import(self, name: str) -> bool:
            raise RuntimeError("boom")

    fix = Broken()
    fix.install()  # must not raise
    assert not fix.waiting_for_import
    assert any("boom" in p for p in fix.status()["problems"])


def test_did_not_enable_means_no_waiting(fresh_modules: Path) -> None:
    class Elsewhere(Fix):
        id = "test-elsewhere"
        runs_in = "EngineCore"
        watches: ClassVar[tuple[str, ...]] = ("mmfix_never",)

        def _install(self) -> None:
            raise DidNotEnable("not an EngineCore process")

        def _uninstall(self) -> None:
            pass

    fix = Elsewhere()
    fix.install()
    assert not fix.enabled and not fix.waiting_for_import
    assert fix.status()["not_enabled_reason"] == "not an EngineCore process"
    assert imports.active() == []


# --------------------------------------------------------------------------- signals


def test_a_signal_reaches_its_receivers_and_a_raising_one_stops_at_the_signal() -> None:
    signal = signals.Signal("test")
    got: list[tuple[Any, ...]] = []

    def broken(*args: Any) -> None:
        raise RuntimeError("receiver bug")

    signal.connect(broken)
    signal.connect(lambda *args: got.append(args))
    signal.send("EngineCore", 0.5)
    assert got == [("EngineCore", 0.5)]
    signal.disconnect(broken)
    assert len(signal.receivers) == 1
