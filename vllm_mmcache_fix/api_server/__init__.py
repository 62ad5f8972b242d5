"""Fixes that act in the API-server process only."""
