"""What the heartbeat's EngineCore side relies on, in every release's own ``core.py``.

The plugin adopts an engine at the busy loop's first ``_process_input_queue`` (both busy
loops call it), stamps ``_process_engine_step`` and ``_handle_client_request``, and hooks the
input queue's ``put_nowait``, which the input thread calls for every request; a utility
request is ``(client_index, call_id, method_name, args)``. Checked on the released sources
(0.10.0-0.34.0), not on a version list.
"""

from __future__ import annotations

import ast

import pytest

from harness import realsrc
from vllm_mmcache_fix import vllm_layout as layout

VERSIONS = realsrc.VERSIONS
CORE = layout.ENGINE_PROC_CLASS.module.replace(".", "/") + ".py"


def _classes(version: str) -> dict[str, ast.ClassDef]:
    tree = realsrc.parse_release_file(version, CORE)
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def _calls_self(func: ast.FunctionDef, name: str) -> bool:
    for node in ast.walk(func):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == name
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self"
        ):
            return True
    return False


@pytest.mark.parametrize("version", VERSIONS)
def test_the_busy_loop_methods_are_on_engine_core_proc(version: str) -> None:
    classes = _classes(version)
    proc = classes[layout.ENGINE_PROC_CLASS.cls]
    assert layout.ENGINE_CORE_CLASS.cls in classes, version
    for method in (layout.BUSY_LOOP_INPUT, layout.BUSY_LOOP_STEP, layout.BUSY_LOOP_DISPATCH):
        assert realsrc.class_method(proc, method) is not None, (version, method)
    # Every busy loop (EngineCoreProc's and the DP subclass's) adopts through the same call.
    loops = [
        loop
        for cls in classes.values()
        if (loop := realsrc.class_method(cls, "run_busy_loop")) is not None
    ]
    assert len(loops) >= 2, version
    for loop in loops:
        assert _calls_self(loop, layout.BUSY_LOOP_INPUT), version
        assert _calls_self(loop, layout.BUSY_LOOP_STEP), version
    # Nobody else defines the input step: a subclass would bypass the adoption.
    defining = [c for c in classes.values() if realsrc.class_method(c, layout.BUSY_LOOP_INPUT)]
    assert [c.name for c in defining] == [layout.ENGINE_PROC_CLASS.cls], version


@pytest.mark.parametrize("version", VERSIONS)
def test_a_dp_rank_waits_for_its_peers_only_where_the_plugin_marks_a_sync(version: str) -> None:
    """The DP busy loop's waits for its peers outside ``_process_engine_step`` are the DP
    all-reduce (``_has_global_unfinished_reqs`` calls one of ``ParallelConfig``'s
    collectives, which ``core.py`` imports by that name) and the dummy batch; the plugin
    marks each as a ``sync`` phase (judged by the step bound). Nothing else of the loop's own
    body calls into the DP group, so an idle rank's wait is never taken for a loop that
    stopped taking requests."""
    tree = realsrc.parse_release_file(version, CORE)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    imported = {
        alias.asname or alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert layout.PARALLEL_CONFIG in imported, version
    dp = classes[layout.DP_ENGINE_PROC_CLASS.cls]
    core = classes[layout.ENGINE_CORE_CLASS.cls]
    sync = realsrc.class_method(dp, layout.DP_SYNC)
    assert sync is not None, version
    called = {
        node.func.attr
        for node in ast.walk(sync)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }
    assert called & set(layout.DP_COLLECTIVES), (version, called)
    assert realsrc.class_method(core, layout.DP_DUMMY_BATCH) is not None, version
    loop = realsrc.class_method(dp, "run_busy_loop")
    assert loop is not None, version
    assert _calls_self(loop, layout.DP_SYNC) and _calls_self(loop, layout.DP_DUMMY_BATCH), version
    text = ast.unparse(loop)
    assert "dp_group" not in text and "all_reduce" not in text, version


@pytest.mark.parametrize("version", VERSIONS)
def test_the_input_thread_hands_every_request_over_with_put_nowait(version: str) -> None:
    proc = _classes(version)[layout.ENGINE_PROC_CLASS.cls]
    reader = realsrc.class_method(proc, "process_input_sockets")
    assert reader is not None, version
    handed = [
        node
        for node in ast.walk(reader)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "put_nowait"
        and isinstance(node.func.value, ast.Attribute)
        and node.func.value.attr == layout.ENGINE_INPUT_QUEUE
    ]
    assert len(handed) == 1, version
    init = realsrc.class_method(proc, "__init__")
    assert init is not None
    assigned = {
        target.attr
        for node in ast.walk(init)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Attribute)
    }
    assert layout.ENGINE_INPUT_QUEUE in assigned, version


@pytest.mark.parametrize("version", VERSIONS)
def test_a_utility_request_names_its_method_third(version: str) -> None:
    proc = _classes(version)[layout.ENGINE_PROC_CLASS.cls]
    dispatch = realsrc.class_method(proc, layout.BUSY_LOOP_DISPATCH)
    assert dispatch is not None
    unpacks = [
        [elt.id for elt in node.targets[0].elts if isinstance(elt, ast.Name)]
        for node in ast.walk(dispatch)
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Tuple)
        and isinstance(node.value, ast.Name)
        and node.value.id == "request"
        and len(node.targets[0].elts) == 4
    ]
    assert unpacks, version
    assert unpacks[0][layout.UTILITY_METHOD_INDEX] == "method_name", (version, unpacks)
    text = ast.unparse(dispatch)
    assert f"{layout.REQUEST_TYPE_UTILITY}" in text and "getattr(self, method_name)" in text
    for name in (layout.REQUEST_TYPE_ADD, layout.REQUEST_TYPE_ABORT):
        assert f"EngineCoreRequestType.{name}" in text, (version, name)


def _self_callers(tree: ast.Module, name: str) -> set[str]:
    """``Class.method`` of every method in the file that calls ``self.<name>(...)``."""
    callers = set()
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for func in cls.body:
            if isinstance(func, ast.FunctionDef) and _calls_self(func, name):
                callers.add(f"{cls.name}.{func.name}")
    return callers


STEP_WAIT = "_wait_for_output"
"""0.34.0+: ``EngineCoreProc._wait_for_output`` waits for a step's model output and, meanwhile,
dispatches the ADD/ABORT requests that arrive (other kinds are deferred to the next
``_process_input_queue``)."""


@pytest.mark.parametrize("version", VERSIONS)
def test_requests_are_dispatched_on_the_busy_loop_only(version: str) -> None:
    """The busy-loop state the heartbeat reports is written by the thread that dispatches.

    Up to 0.33.0 only ``_process_input_queue`` dispatches; 0.34.0 also dispatches ADD and
    ABORT from inside a step (``_wait_for_output``, called by the step functions), so an
    ADD is entered while the step's phase is open: the plugin's ``LoopState`` returns to
    the step with its start time kept (``tests/unit/test_engine_answer.py``), and a utility
    call, the heartbeat's ping among them, is never run inside a step.
    """
    tree = realsrc.parse_release_file(version, CORE)
    proc = layout.ENGINE_PROC_CLASS.cls
    callers = _self_callers(tree, layout.BUSY_LOOP_DISPATCH)
    assert f"{proc}.{layout.BUSY_LOOP_INPUT}" in callers, version
    assert callers <= {f"{proc}.{layout.BUSY_LOOP_INPUT}", f"{proc}.{STEP_WAIT}"}, callers
    if f"{proc}.{STEP_WAIT}" not in callers:
        assert realsrc.version_key(version) < (0, 34), version
        return
    # Called only from the step functions that _process_engine_step runs.
    waiters = {c.split(".")[1] for c in _self_callers(tree, STEP_WAIT)}
    assert waiters and waiters <= {"step", "step_with_batch_queue"}, waiters
    during = next(
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(
            isinstance(t, ast.Name) and t.id == "_INPUTS_HANDLED_DURING_STEP" for t in node.targets
        )
    )
    kinds = {
        ast.unparse(e).rsplit(".", 1)[-1] for e in ast.walk(during) if isinstance(e, ast.Attribute)
    }
    assert {layout.REQUEST_TYPE_ADD, layout.REQUEST_TYPE_ABORT} <= kinds, kinds
    assert layout.REQUEST_TYPE_UTILITY not in kinds, kinds


@pytest.mark.parametrize("version", VERSIONS)
def test_every_abort_goes_through_the_method_the_plugin_wraps(version: str) -> None:
    """A client's abort is not progress: the plugin learns of every abort from
    ``EngineCore.abort_requests``. Between steps the ABORT request calls it; from 0.13.0 a
    step also aborts what the input thread put on ``aborts_queue`` meanwhile, through
    ``_process_aborts_queue``, which calls it too. No other code in ``core.py`` takes a
    request out of the scheduler for an abort."""
    classes = _classes(version)
    core = classes[layout.ENGINE_CORE_CLASS.cls]
    assert realsrc.class_method(core, layout.ENGINE_ABORT) is not None, version
    dispatch = realsrc.class_method(
        classes[layout.ENGINE_PROC_CLASS.cls], layout.BUSY_LOOP_DISPATCH
    )
    assert dispatch is not None and _calls_self(dispatch, layout.ENGINE_ABORT), version
    drains = realsrc.class_method(core, "_process_aborts_queue")
    if tuple(int(p) for p in version.split(".")[:2]) >= (0, 13):
        assert drains is not None and _calls_self(drains, layout.ENGINE_ABORT), version
        for name in ("step", "step_with_batch_queue"):
            step = realsrc.class_method(core, name)
            assert step is not None and _calls_self(step, "_process_aborts_queue"), version
    else:
        assert drains is None, version
    text = ast.unparse(realsrc.parse_release_file(version, CORE))
    assert text.count("FINISHED_ABORTED") == text.count(
        "finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)"
    ) + text.count("finish_requests(None, RequestStatus.FINISHED_ABORTED)"), version


@pytest.mark.parametrize("version", VERSIONS)
def test_the_idle_loops_callbacks_run_where_the_plugin_marks_a_utility(version: str) -> None:
    """From 0.17.0 a pause or a sleep that waits for in-flight requests leaves its work (a
    sleep: the executor's offload) to ``EngineCoreProc._notify_idle_state_callbacks``, which
    ``_process_input_queue`` calls while the loop has no work; the plugin marks it as a
    utility call. It is the only place those callbacks run."""
    classes = _classes(version)
    proc = classes[layout.ENGINE_PROC_CLASS.cls]
    notify = realsrc.class_method(proc, layout.IDLE_CALLBACKS)
    text = ast.unparse(realsrc.parse_release_file(version, CORE))
    if notify is None:
        assert layout.IDLE_CALLBACK_LIST not in text, version
        assert tuple(int(p) for p in version.split(".")[:2]) < (0, 17), version
        return
    loop = realsrc.class_method(proc, layout.BUSY_LOOP_INPUT)
    assert loop is not None and _calls_self(loop, layout.IDLE_CALLBACKS), version
    assert f"self.{layout.IDLE_CALLBACK_LIST}.pop()" in ast.unparse(notify), version
    assert text.count(f"{layout.IDLE_CALLBACK_LIST}.pop(") == 1, version
