"""Machinery the fixes share, in every process: logging and message texts,
settings, the one import-hook owner, the registry of originals, the fix
lifecycle and the guard around the plugin's own work."""
