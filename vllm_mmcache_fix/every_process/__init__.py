"""Fixes that act in every vLLM process: API server, EngineCore, workers."""
