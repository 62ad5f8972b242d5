"""A release's own multimodal cache classes and ``_merge_mm_kwargs``, run without vLLM.

:mod:`harness.realsrc` loads a release's real ``LRUCache``; this module goes one
layer up. From the released files it executes:

* every top-level class of the file that defines ``MultiModalCache.get_lru_cache``
  (``MultiModalCache``, the processor-only cache, the cache base classes), and of the
  file that defines the LRU sender cache (``vllm_layout.DRIFT_TARGETS``);
* ``BaseMultiModalProcessor._merge_mm_kwargs``, the function itself, placed in a small
  processor class whose ``apply`` does what vLLM's does around it (``is_cached`` of
  every item, the misses processed, then the merge).

Each statement is compiled from the release's own syntax tree with its file name and
line numbers, under ``from __future__ import annotations`` (so the many annotation-only
names need not exist). vLLM's imports are not run: stdlib imports are, the real
``LRUCache`` stands in for ``vllm.utils.cache``, and every other imported name is a
placeholder class (a ``dict`` subclass, as ``MultiModalKwargsItems`` is a mapping),
except the few helpers the cache code calls (``json_*_leaves``, ``GiB_bytes``,
``format_gib``, ``init_logger``, ``torch.Tensor``, ``override``), given small stand-ins.

:func:`install` registers the modules under vLLM's own names, so the plugin's fixes
find and patch them exactly as in a server; :func:`remove` takes them out again.
"""

from __future__ import annotations
import __future__

import ast
import logging
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import realsrc
from vllm_mmcache_fix import vllm_layout

_ANNOTATIONS = __future__.annotations.compiler_flag


class Tensor:
    """``torch.Tensor`` as the cache code sees it: something with ``nbytes``."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __repr__(self) -> str:
        return f"Tensor({self.nbytes})"


class KwargsItem(dict):
    """``MultiModalKwargsItem`` (a mapping whose ``data`` is the dict): one processed image."""

    @property
    def data(self) -> dict[str, Any]:
        return dict(self)


def image(mm_hash: str, nbytes: int) -> KwargsItem:
    """A processed image of ``nbytes`` (the size vLLM's ``get_item_size`` reads)."""
    return KwargsItem(pixel_values=Tensor(nbytes), mm_hash=mm_hash)


def _map_leaves(fn: Callable[[Any], Any], value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _map_leaves(fn, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_leaves(fn, v) for v in value)
    return fn(value)


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def _reduce_leaves(fn: Callable[[Any, Any], Any], value: Any, *initial: Any) -> Any:
    items = list(_leaves(value))
    acc = initial[0] if initial else items.pop(0)
    for item in items:
        acc = fn(acc, item)
    return acc


class _Logger(logging.LoggerAdapter):
    def warning_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self.warning(msg, *args, **kwargs)

    def info_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self.info(msg, *args, **kwargs)

    def debug_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self.debug(msg, *args, **kwargs)


def _helpers(lru_module: types.ModuleType) -> dict[str, Any]:
    return {
        "torch": types.SimpleNamespace(Tensor=Tensor),
        "MultiModalKwargsItem": KwargsItem,
        "image": image,
        "override": lambda func: func,
        "LRUCache": lru_module.LRUCache,
        "CacheInfo": getattr(lru_module, "CacheInfo", None),
        "json_map_leaves": _map_leaves,
        "json_reduce_leaves": _reduce_leaves,
        "json_count_leaves": lambda value: sum(1 for _ in _leaves(value)),
        "GiB_bytes": 1 << 30,
        "format_gib": lambda b: f"{b / (1 << 30):.4f}",
        "init_logger": lambda name: _Logger(logging.getLogger(name), {}),
    }


def _placeholder(name: str) -> type:
    return type(name, (KwargsItem,), {"__module__": "vllm (placeholder)"})


def _bound_by_import(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.Import):
        return [(a.asname or a.name).split(".")[0] for a in node.names]
    if isinstance(node, ast.ImportFrom):
        return [a.asname or a.name for a in node.names if a.name != "*"]
    return []


def _is_stdlib_import(node: ast.stmt) -> bool:
    if isinstance(node, ast.Import):
        return all(a.name.split(".")[0] in sys.stdlib_module_names for a in node.names)
    if isinstance(node, ast.ImportFrom):
        return (
            not node.level
            and node.module is not None
            and node.module.split(".")[0] in sys.stdlib_module_names
            and node.module != "__future__"
        )
    return False


def exec_module(
    path: Path, name: str, namespace: dict[str, Any], *, keep: Callable[[ast.stmt], bool]
) -> tuple[types.ModuleType, list[str]]:
    """Run the chosen top-level statements of ``path`` as module ``name``.

    Imports of the standard library run; other imports bind the helper of the same name
    from ``namespace`` or a placeholder class. Kept statements run one by one in file
    order; one that raises ``NameError``/``TypeError`` (it needs more of vLLM than this
    module provides) is skipped and its line reported, never silently half-run.
    """
    tree = realsrc.parse(path)
    module = types.ModuleType(name)
    module.__file__ = str(path)
    scope = module.__dict__
    skipped: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if _is_stdlib_import(node):
                exec(compile(ast.Module([node], []), str(path), "exec"), scope)  # noqa: S102
                continue
            for bound in _bound_by_import(node):
                scope.setdefault(bound, namespace.get(bound) or _placeholder(bound))
            continue
        if isinstance(node, ast.If):
            continue  # TYPE_CHECKING blocks and the like
        if not keep(node):
            continue
        code = compile(ast.Module([node], []), str(path), "exec", flags=_ANNOTATIONS)
        try:
            exec(code, scope)  # noqa: S102
        except (NameError, TypeError, AttributeError) as exc:
            skipped.append(f"{path.name}:{node.lineno}: {exc}")
    return module, skipped


def _keep_definitions(node: ast.stmt) -> bool:
    """Classes, and the type variables and aliases the class statements use."""
    if isinstance(node, ast.ClassDef):
        return True
    return isinstance(node, (ast.Assign, ast.AnnAssign))


def _module_file(version: str, module: str) -> str | None:
    for rel in (module.replace(".", "/") + ".py", module.replace(".", "/") + "/__init__.py"):
        if realsrc.has_file(version, rel):
            return rel
    return None


def _first_candidate(version: str, name: str) -> tuple[vllm_layout.ClassLayout, str]:
    target = next(t for t in vllm_layout.DRIFT_TARGETS if t.name == name)
    for candidate in target.candidates:
        rel = _module_file(version, candidate.module)
        if rel is None:
            continue
        cls = realsrc.top_level_class(realsrc.parse_release_file(version, rel), candidate.cls)
        if cls is not None:
            return candidate, rel
    raise LookupError(f"vllm {version}: no {name} class among {target.candidates}")


def merge_function(version: str) -> tuple[vllm_layout.ClassLayout, str, ast.FunctionDef]:
    """The processor's layout, its file and the syntax tree of its ``_merge_mm_kwargs``."""
    layout, rel = _first_candidate(version, "processor")
    node = realsrc.top_level_class(realsrc.parse_release_file(version, rel), layout.cls)
    merge = None if node is None else realsrc.class_method(node, "_merge_mm_kwargs")
    if merge is None:
        raise LookupError(f"vllm {version}: {layout.cls} has no _merge_mm_kwargs")
    return layout, rel, merge


# The processor around the real _merge_mm_kwargs: what vLLM's apply() does with the cache.
_PROCESSOR_SRC = '''
class BaseMultiModalProcessor:
    def __init__(self, cache):
        self.cache = cache

    def _recompute_cached_prompt_update(self, update, item_idx):
        return update

    def apply(self, items):
        """``items``: ``[(mm_hash, nbytes), ...]`` of one request's images."""
        hashes = [h for h, _ in items]
        cached = self.cache.is_cached(hashes)
        missing = [(h, n) for (h, n), hit in zip(items, cached) if not hit]
        return self._merge_mm_kwargs(
            self.cache,
            mm_hashes={"image": hashes},
            mm_is_cached={"image": cached},
            mm_missing_kwargs={"image": [image(h, n) for h, n in missing]},
            mm_missing_prompt_updates={"image": [[("update", h)] for h, _ in missing]},
        )
'''

_INPUT_PROCESSOR_SRC = '''
class InputProcessor:
    """The commit point: a request passes (commit) or is rejected (rollback)."""

    def process_inputs(self, request_id, prompt, params, reject=False, **kwargs):
        if reject:
            raise ValueError(f"request {request_id} rejected after multimodal processing")
        return {"request_id": request_id, "prompt": prompt}
'''


@dataclass
class ReleaseCode:
    version: str
    modules: dict[str, types.ModuleType]
    factory: vllm_layout.FactoryLayout
    sender_cls: type
    only_cls: type | None
    """The processor-only cache (``MultiModalProcessorOnlyCache``), when the release has it."""
    processor_cls: type
    input_processor_cls: type
    merge_source: str
    """``file:line`` of the released ``_merge_mm_kwargs``."""
    skipped: list[str] = field(default_factory=list)

    def config(self, capacity_bytes: float) -> Any:
        """A model config whose multimodal cache holds ``capacity_bytes``."""
        gb = capacity_bytes / (1 << 30)
        mm = types.SimpleNamespace(mm_processor_cache_gb=gb)
        return types.SimpleNamespace(get_multimodal_config=lambda: mm)


def load(version: str) -> ReleaseCode:
    """Execute the release's cache classes and ``_merge_mm_kwargs`` (nothing registered)."""
    lru_module = realsrc.load_lru_module(version)
    helpers = _helpers(lru_module)
    factory = next(f for f in vllm_layout.FACTORY_LAYOUTS if realsrc.has_file(version, f.file))
    modules: dict[str, types.ModuleType] = {}
    skipped: list[str] = []
    base, miss = exec_module(
        realsrc.source_file(version, factory.file),
        factory.module,
        helpers,
        keep=_keep_definitions,
    )
    modules[factory.module] = base
    skipped += miss

    sender_layout, sender_rel = _first_candidate(version, "sender")
    if sender_layout.module in modules:
        sender_mod = modules[sender_layout.module]
    else:
        names = dict(helpers)
        names.update({k: v for k, v in vars(base).items() if not k.startswith("__")})
        sender_mod, miss = exec_module(
            realsrc.source_file(version, sender_rel),
            sender_layout.module,
            names,
            keep=_keep_definitions,
        )
        modules[sender_layout.module] = sender_mod
        skipped += miss
    sender_cls = getattr(sender_mod, sender_layout.cls)

    proc_layout, proc_rel, merge = merge_function(version)
    proc_path = realsrc.source_file(version, proc_rel)
    proc_tree = realsrc.parse(proc_path)
    proc_mod = types.ModuleType(proc_layout.module)
    proc_mod.__file__ = str(proc_path)
    scope = proc_mod.__dict__
    scope.update(helpers)
    for node in proc_tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if _is_stdlib_import(node):
                exec(compile(ast.Module([node], []), str(proc_path), "exec"), scope)  # noqa: S102
            else:
                for bound in _bound_by_import(node):
                    scope.setdefault(bound, _placeholder(bound))
        elif isinstance(node, ast.ClassDef):
            # The file's other classes appear in _merge_mm_kwargs only as type arguments.
            scope.setdefault(node.name, _placeholder(node.name))
    exec(compile(_PROCESSOR_SRC, f"<harness processor for vllm {version}>", "exec"), scope)  # noqa: S102
    merge_code = compile(ast.Module([merge], []), str(proc_path), "exec", flags=_ANNOTATIONS)
    merge_ns: dict[str, Any] = {}
    exec(merge_code, scope, merge_ns)  # noqa: S102
    merge_func = merge_ns["_merge_mm_kwargs"]
    merge_func.__qualname__ = f"{proc_layout.cls}._merge_mm_kwargs"
    processor_cls = scope["BaseMultiModalProcessor"]
    processor_cls._merge_mm_kwargs = merge_func
    processor_cls.__module__ = proc_layout.module
    modules[proc_layout.module] = proc_mod

    ip_layout = next(t for t in vllm_layout.DRIFT_TARGETS if t.name == "process_inputs")
    ip_module = ip_layout.candidates[0].module
    ip_mod = types.ModuleType(ip_module)
    exec(compile(_INPUT_PROCESSOR_SRC, f"<harness {ip_module}>", "exec"), ip_mod.__dict__)  # noqa: S102
    ip_cls = ip_mod.__dict__["InputProcessor"]
    ip_cls.__module__ = ip_module
    modules[ip_module] = ip_mod

    return ReleaseCode(
        version=version,
        modules=modules,
        factory=factory,
        sender_cls=sender_cls,
        only_cls=getattr(base, "MultiModalProcessorOnlyCache", None),
        processor_cls=processor_cls,
        input_processor_cls=ip_cls,
        merge_source=f"{proc_rel}:{merge.lineno}",
        skipped=skipped,
    )


def install(version: str) -> ReleaseCode:
    """:func:`load`, then register its modules (and their parent packages) in ``sys.modules``."""
    code = load(version)
    for name, module in code.modules.items():
        parts = name.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent not in sys.modules:
                pkg = types.ModuleType(parent)
                pkg.__path__ = []
                sys.modules[parent] = pkg
                _REGISTERED.append(parent)
        sys.modules[name] = module
        _REGISTERED.append(name)
    return code


_REGISTERED: list[str] = []


def remove() -> None:
    """Take every module :func:`install` registered out of ``sys.modules``."""
    while _REGISTERED:
        sys.modules.pop(_REGISTERED.pop(), None)
