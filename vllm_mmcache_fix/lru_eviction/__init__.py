"""The eviction-safe LRU — runs in **every process** (API server, EngineCore, workers).

vLLM's ``LRUCache`` can hold a key in its eviction order that has no data; its
``popitem`` then removes nothing and cachetools' eviction loop spins forever
(vllm#43941). Every cache vLLM builds through its multimodal factory
``get_lru_cache`` gets its class switched to a direct subclass of the
installed vLLM's own ``LRUCache`` whose ``touch``, ``popitem`` and ``clear``
always make progress.

- ``cache``: the fixed class (pure: no vLLM, testable on released sources)
- ``probe``: does a given ``LRUCache`` class show the bug?
- ``locate``: find the factory in the installed vLLM (facts in ``vllm_layout``)
- ``factory``: the wrapper around the factory
- ``report``: the start-up line
- ``fix``: the lifecycle (``LruEvictionFix``)
"""
