"""Texts that scripts, tests and operators grep for in the server log.

Emitters format these; parsers (the development harness, ``grep`` in the
README) match on them. Change one here and both sides follow.
"""

from __future__ import annotations

PREFIX = "vllm-mmcache-fix: "
"""Every line of the plugin starts with this."""

ACTIVE = "active in"
"""The eviction fix is in place in a process: ``active in <process> pid=N, vLLM X: ...``."""

NOT_PROTECTED = "NOT protected in"
REPAIRED = "repaired a multimodal cache"
DRIFT_GUARD_ACTIVE = "drift guard active in"
DRIFT_RECOVERY_ACTIVE = "drift recovery active in"
DRIFT_EVENT = "P0/P1 multimodal cache drift"
ROLLBACK = "undid the multimodal cache changes"
INTERNAL_ERROR = "internal error"
"""The plugin's own code raised; what it guarded was switched off, vLLM went on."""
ENGINE_NOT_ANSWERING = "EngineCore does not answer"
"""``/health`` fails: EngineCore's input thread left two heartbeat pings unanswered, the older
one past the timeout (the thread is dead or spinning)."""
ENGINE_LOOP_STUCK = "EngineCore's busy loop is stuck"
"""``/health`` fails: EngineCore answered that its busy loop has been inside one step (or one
add/abort) for longer than the timeout."""
ENGINE_ANSWERS_AGAIN = "EngineCore answers again"
"""An engine ``/health`` had failed for is healthy again (it answered, its loop moved on)."""
ENGINE_CHECK_OFF = "engine liveness check off for"
"""An engine cannot answer the heartbeat (no ping method, an old client, answers from its busy
loop only): ``/health`` no longer judges it; one WARNING per engine."""
LIVENESS_ACTIVE = "engine liveness on /health in"
"""The API server's heartbeat started: ``engine liveness on /health in <process> ...``."""
ANSWER_ACTIVE = "engine liveness answer in"
"""EngineCore's input thread answers the heartbeat: ``engine liveness answer in <process> ...``."""
STALL = "thread stalled in"
"""The stall sentinel saw a thread stay in one place burning CPU inside the multimodal cache's
eviction (vllm#43941): ``thread stalled in <process> pid=N: thread 'NAME' (tid N) ...`` then its
stack."""
BUSY = "thread busy in one call"
"""The stall sentinel saw a thread stay in one call burning CPU elsewhere (a long tokenization,
a CPU forward pass): ``thread busy in one call for N s in <process> pid=N: ...`` then its
stack. Not the cache bug; counted apart (``cause="busy"``)."""
STALL_SENTINEL_ACTIVE = "stall sentinel running in"
