"""Development harness of vllm-mmcache-fix: venvs, released sources, real servers, figures.

Development only: it is not part of the wheel (``[tool.setuptools] packages`` in
pyproject.toml lists the plugin's packages only). Run its programs from the
repository root, through the thin commands in ``scripts/`` or as
``python -m harness.<module>``; the tests import it the same way.
"""
