"""Defects the concurrency tier must catch, put back as they were (for its mutant runs)."""

from __future__ import annotations

from vllm_mmcache_fix.drift_guard import journal


def unlocked_registration(self: journal.Journal, shadow: journal.Shadow) -> None:
    """The registration as it was: ``pending`` changed without the shadow's lock."""
    self.shadow = shadow
    shadow.pending[self] = None
    self.epoch = shadow.epoch
    self.state = journal.PENDING
    self.prev_seq = {}
    self.my_seq = {}
    self.inserted = []
    self.adopted = {}
    self.evicted = []
    self.evictions_mark = None
    self.sent_without_data = 0
    self.cleared = []
