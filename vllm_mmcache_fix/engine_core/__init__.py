"""Fixes that act in EngineCore's process only."""
