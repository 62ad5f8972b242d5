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
"""``/health`` fails: an EngineCore left the liveness round trip unanswered past the timeout."""
ENGINE_ANSWERS_AGAIN = "EngineCore answers again"
STALL = "thread stalled in"
"""The stall sentinel saw a thread stay in one place burning CPU:
``thread stalled in <process> pid=N: thread 'NAME' (tid N) ...`` then its stack."""
STALL_SENTINEL_ACTIVE = "stall sentinel running in"
