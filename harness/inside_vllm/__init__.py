"""Code that runs inside a vLLM venv's own processes: site hooks put on a server's
``PYTHONPATH``, pytest plugins and checks started with that venv's Python."""
