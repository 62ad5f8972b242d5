"""Programs that produce evidence: each runs real vLLM (servers, released sources) and
records or prints what it found (``python -m harness COMMAND`` lists them)."""
