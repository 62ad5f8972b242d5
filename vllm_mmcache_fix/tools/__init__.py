"""Operator tools: ``check``, ``diagnose``, ``patch`` and the command line.

Run by people and image builds, never by vLLM: ``register()`` imports none of this.
"""
