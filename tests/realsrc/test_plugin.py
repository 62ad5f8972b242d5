"""The plugin's wiring, each case in a fresh interpreter.

Import orders (patch before and after vLLM's import, twice, patch-unpatch-
patch), modes, bad input and fail-open behaviour, on synthetic layouts that
carry the real released ``LRUCache`` of the version under test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.layouts import run_snippet, write_layout
from vllm_mmcache_fix import __version__
from vllm_mmcache_fix.catalogue import NEWEST_SOURCES_CHECKED as NEWEST

LAYOUTS = {
    "package": (NEWEST, "vllm.multimodal.cache.base"),
    "module": ("0.23.0", "vllm.multimodal.cache"),
}


@pytest.fixture
def tree(tmp_path: Path, lru_source):
    def make(layout: str, version: str = "0.23.0") -> Path:
        return write_layout(tmp_path, layout, lru_source(version), version=version)

    return make


def _messages(result: dict, level: str | None = None, *, drift: bool = False) -> list[str]:
    """Logged lines; the drift guard's own lines only when asked for."""
    return [
        m
        for _, lvl, m in result["logs"]
        if (level is None or lvl == level) and (drift or "drift guard" not in m)
    ]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_patch_after_import(tree, layout: str) -> None:
    version, module = LAYOUTS[layout]
    root = tree(layout, version)
    result = run_snippet(
        root,
        f"""
        import {module} as m
        import vllm_mmcache_fix
        vllm_mmcache_fix.register()
        cache = m.MultiModalCache.get_lru_cache(1024 / (1 << 30), bytes)
        report(cls=type(cache).__name__, progress=ghost_sequence(cache),
               status=vllm_mmcache_fix.status())
        """,
    )
    assert result["cls"] == "FixedLRUCache"
    assert result["progress"] is True
    assert result["status"]["installed"] is True
    assert result["status"]["target"] == f"{module}.MultiModalCache.get_lru_cache"
    assert result["status"]["repairs"]["ghost_keys_dropped"] == 1
    assert result["status"]["problems"] == []
    assert len(_messages(result, "WARNING")) == 1  # the repair, nothing else
    info = _messages(result, "INFO")
    assert len(info) == 1 and info[0].startswith("vllm-mmcache-fix: active in")
    assert all(m.startswith("vllm-mmcache-fix: ") for m in _messages(result, drift=True))
    assert all(name.startswith("vllm.") for name, _, _ in result["logs"])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_patch_before_import(tree, layout: str) -> None:
    version, module = LAYOUTS[layout]
    root = tree(layout, version)
    result = run_snippet(
        root,
        f"""
        import vllm, vllm_mmcache_fix
        vllm_mmcache_fix.register()
        waiting = vllm_mmcache_fix.status()["waiting_for_import"]
        import {module} as m
        cache = m.MultiModalCache.get_lru_cache(1024 / (1 << 30), bytes)
        from vllm_mmcache_fix import plugin
        report(waiting=waiting, cls=type(cache).__name__, progress=ghost_sequence(cache),
               hook=plugin.LRU_EVICTION.waiting_for_import,
               loader=type(m.__loader__).__name__)
        """,
    )
    assert result["waiting"] is True
    assert result["cls"] == "FixedLRUCache"
    assert result["progress"] is True
    assert result["hook"] is False
    assert result["loader"] == "SourceFileLoader"


def test_register_twice_patches_once(tree) -> None:
    root = tree("module")
    result = run_snippet(
        root,
        """
        import vllm.multimodal.cache as m
        import vllm_mmcache_fix
        from vllm_mmcache_fix.core import registry
        vllm_mmcache_fix.register(); vllm_mmcache_fix.register()
        cache = m.MultiModalCache.get_lru_cache(1.0, bytes)
        report(patches=len(registry.applied()), mro=[c.__name__ for c in type(cache).__mro__])
        """,
    )
    assert result["patches"] == 1
    assert result["mro"][:2] == ["FixedLRUCache", "LRUCache"]
    assert len(_messages(result, "INFO")) == 1


def test_patch_unpatch_patch(tree) -> None:
    root = tree("module")
    result = run_snippet(
        root,
        """
        import vllm.multimodal.cache as m
        import vllm_mmcache_fix
        original = m.MultiModalCache.__dict__["get_lru_cache"]
        vllm_mmcache_fix.instrument()
        first = m.MultiModalCache.get_lru_cache(1.0, bytes)
        patched = m.MultiModalCache.__dict__["get_lru_cache"] is not original
        vllm_mmcache_fix.uninstrument()
        restored = m.MultiModalCache.__dict__["get_lru_cache"] is original
        plain = m.MultiModalCache.get_lru_cache(1.0, bytes)
        first_after = type(first).__name__
        vllm_mmcache_fix.instrument()
        again = m.MultiModalCache.get_lru_cache(1.0, bytes)
        report(patched=patched, restored=restored, plain=type(plain).__name__,
               first_after=first_after, again=type(again).__name__)
        """,
    )
    assert result == result | {
        "patched": True,
        "restored": True,
        "plain": "LRUCache",
        "first_after": "LRUCache",
        "again": "FixedLRUCache",
    }


def test_only_multimodal_caches_are_fixed(tree) -> None:
    root = tree("module")
    result = run_snippet(
        root,
        """
        import vllm.multimodal.cache as m
        from vllm.utils.cache import LRUCache
        import vllm_mmcache_fix
        vllm_mmcache_fix.register()
        lora_like = LRUCache(10)
        report(lora=type(lora_like).__name__,
               mm=type(m.MultiModalCache.get_lru_cache(1.0, bytes)).__name__)
        """,
    )
    assert result["lora"] == "LRUCache"
    assert result["mm"] == "FixedLRUCache"


def test_static_factory_layout(tree) -> None:
    root = tree("processing")
    result = run_snippet(
        root,
        """
        import vllm.multimodal.processing as p
        import vllm_mmcache_fix
        vllm_mmcache_fix.register()
        report(cls=type(p.ProcessingCache.get_lru_cache(1.0, bytes)).__name__,
               target=vllm_mmcache_fix.status()["target"])
        """,
    )
    assert result["cls"] == "FixedLRUCache"
    assert result["target"] == "vllm.multimodal.processing.ProcessingCache.get_lru_cache"


def test_unknown_layout_applies_nothing_and_says_why(tree) -> None:
    root = tree("unknown")
    result = run_snippet(
        root,
        """
        import vllm.multimodal.cache, vllm.multimodal.processing
        import vllm_mmcache_fix
        vllm_mmcache_fix.register()
        from vllm.utils.cache import LRUCache
        report(status=vllm_mmcache_fix.status(), works=len(LRUCache(4)) == 0)
        """,
    )
    assert result["works"] is True
    assert result["status"]["installed"] is False
    assert "unrecognised vLLM layout" in result["status"]["not_applied_reason"]
    warnings = _messages(result, "WARNING")
    assert len(warnings) == 1
    assert "NOT protected" in warnings[0] and "--mm-processor-cache-gb 0" in warnings[0]


def test_mode_warn_patches_nothing_and_warns_once_when_cache_on(tree) -> None:
    root = tree("module")
    result = run_snippet(
        root,
        """
        import vllm.multimodal.cache as m
        import vllm_mmcache_fix
        vllm_mmcache_fix.register()
        off = m.MultiModalCache.get_lru_cache(0.0, bytes)
        none_yet = len(records)
        a = m.MultiModalCache.get_lru_cache(4.0, bytes)
        b = m.MultiModalCache.get_lru_cache(4.0, bytes)
        report(none_yet=none_yet, cls=type(a).__name__, status=vllm_mmcache_fix.status())
        """,
        env={"MMCACHE_FIX_MODE": "warn"},
    )
    assert result["cls"] == "LRUCache"
    assert result["none_yet"] == 0
    warnings = _messages(result, "WARNING")
    assert len(warnings) == 1
    assert "NOT protected" in warnings[0] and "--mm-processor-cache-gb=4" in warnings[0]
    assert result["status"]["installed"] is False


def test_mode_warn_is_quiet_on_a_vllm_without_ghost_touch(tree) -> None:
    root = tree("package", NEWEST)
    result = run_snippet(
        root,
        """
        import vllm.multimodal.cache.base as m
        import vllm_mmcache_fix
        vllm_mmcache_fix.register()
        m.MultiModalCache.get_lru_cache(4.0, bytes)
        report()
        """,
        env={"MMCACHE_FIX_MODE": "warn"},
    )
    assert _messages(result, "WARNING") == []


def test_mode_off_does_nothing(tree) -> None:
    root = tree("module")
    result = run_snippet(
        root,
        """
        import vllm.multimodal.cache as m
        import vllm_mmcache_fix
        vllm_mmcache_fix.register()
        report(cls=type(m.MultiModalCache.get_lru_cache(4.0, bytes)).__name__,
               hooks=len(vllm_mmcache_fix.core.imports.active()))
        """,
        env={"MMCACHE_FIX_MODE": "off"},
    )
    assert result["cls"] == "LRUCache"
    assert result["hooks"] == 0
    assert _messages(result, "WARNING") == []
    assert any("disabled by MMCACHE_FIX_MODE=off" in m for m in _messages(result, "INFO"))


@pytest.mark.parametrize("value", ["yes", "ON!", "0", "disable"])
def test_bad_mode_warns_and_uses_default(tree, value: str) -> None:
    root = tree("module")
    result = run_snippet(
        root,
        """
        import vllm.multimodal.cache as m
        import vllm_mmcache_fix
        vllm_mmcache_fix.register()
        report(cls=type(m.MultiModalCache.get_lru_cache(4.0, bytes)).__name__)
        """,
        env={"MMCACHE_FIX_MODE": value},
    )
    assert result["cls"] == "FixedLRUCache"
    warnings = _messages(result, "WARNING")
    assert len(warnings) == 1 and "MMCACHE_FIX_MODE" in warnings[0] and "'on'" in warnings[0]


def test_register_never_raises(tree) -> None:
    root = tree("module")
    result = run_snippet(
        root,
        """
        import vllm.multimodal.cache as m
        import vllm_mmcache_fix
        from vllm_mmcache_fix.lru_eviction import fix
        def boom(**kwargs):
            raise RuntimeError("simulated bug")
        fix.locate_mm_cache_factory = boom
        vllm_mmcache_fix.register()
        report(cls=type(m.MultiModalCache.get_lru_cache(4.0, bytes)).__name__)
        """,
    )
    assert result["cls"] == "LRUCache"
    warnings = _messages(result, "WARNING")
    assert len(warnings) == 1 and "simulated bug" in warnings[0]


def test_incompatible_cache_is_left_to_vllm(tree) -> None:
    root = tree("module")
    result = run_snippet(
        root,
        """
        import vllm.multimodal.cache as m
        import vllm_mmcache_fix
        vllm_mmcache_fix.register()
        # A cachetools that renamed its private order dict.
        original = m.LRUCache.__init__
        def init(self, *a, **k):
            original(self, *a, **k)
            self._renamed = self.__dict__.pop("_LRUCache__order")
        m.LRUCache.__init__ = init
        cache = m.MultiModalCache.get_lru_cache(4.0, bytes)
        report(cls=type(cache).__name__, status=vllm_mmcache_fix.status())
        """,
    )
    assert result["cls"] == "LRUCache"
    warnings = _messages(result, "WARNING")
    assert len(warnings) == 1 and "_LRUCache__order" in warnings[0]


def test_importing_the_package_does_not_import_vllm(tree) -> None:
    root = tree("module")
    result = run_snippet(
        root,
        """
        import vllm_mmcache_fix, vllm_mmcache_fix.tools.cli, vllm_mmcache_fix.tools.check
        report(vllm=[m for m in sys.modules if m == "vllm" or m.startswith("vllm.")])
        """,
    )
    assert result["vllm"] == []


def test_repairs_are_logged_rate_limited(tree) -> None:
    root = tree("module")
    result = run_snippet(
        root,
        """
        import vllm.multimodal.cache as m
        import vllm_mmcache_fix
        vllm_mmcache_fix.register()
        cache = m.MultiModalCache.get_lru_cache(1024 / (1 << 30), bytes)
        for round in range(5):
            cache._LRUCache__order[f"ghost-{round}"] = None
            cache._LRUCache__order.move_to_end(f"ghost-{round}", last=False)
            for i in range(20):
                cache[f"r{round}-{i}"] = b"x" * 100
        report(status=vllm_mmcache_fix.status())
        """,
    )
    assert result["status"]["repairs"]["ghost_keys_dropped"] == 5
    warnings = _messages(result, "WARNING")
    assert len(warnings) == 1 and "repaired a multimodal cache" in warnings[0]


def test_active_line_waits_until_vllm_logging_is_set_up(tree) -> None:
    """vLLM 0.32 configures logging after plugins load in the API server."""
    root = tree("module")
    result = run_snippet(
        root,
        """
        import vllm.multimodal.cache as m
        import vllm_mmcache_fix
        keep = _vllm_logger.handlers[:]
        _vllm_logger.handlers.clear()
        _vllm_logger.propagate = True  # as before vLLM configures it; root has none
        vllm_mmcache_fix.register()
        before = len(records)
        _vllm_logger.handlers[:] = keep
        _vllm_logger.propagate = False
        m.MultiModalCache.get_lru_cache(1.0, bytes)
        m.MultiModalCache.get_lru_cache(1.0, bytes)
        report(before=before)
        """,
    )
    assert result["before"] == 0
    info = _messages(result, "INFO")
    assert len(info) == 1 and info[0].startswith("vllm-mmcache-fix: active in")


@pytest.mark.parametrize("version", ["0.23.0+empty", "0.24.0.dev12+g1234abc", "weird"])
def test_editable_dev_and_odd_version_strings(tmp_path: Path, lru_source, version: str) -> None:
    """Ascend editable builds read ``0.23.0+empty``; the probe decides, not the string."""
    root = write_layout(tmp_path, "module", lru_source("0.23.0"), version=version)
    result = run_snippet(
        root,
        """
        import vllm.multimodal.cache as m
        import vllm_mmcache_fix
        vllm_mmcache_fix.register()
        cache = m.MultiModalCache.get_lru_cache(1024 / (1 << 30), bytes)
        report(cls=type(cache).__name__, progress=ghost_sequence(cache),
               status=vllm_mmcache_fix.status())
        """,
    )
    assert result["cls"] == "FixedLRUCache" and result["progress"] is True
    assert result["status"]["vllm_version"] == version
    assert result["status"]["exposure"]["touch_creates_ghost"] is True
    # The active line names both versions: vLLM's as it reads itself, then the plugin's.
    assert f"vLLM {version}, vllm-mmcache-fix {__version__}:" in _messages(result, "INFO")[0]
