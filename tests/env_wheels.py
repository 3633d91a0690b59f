"""Tiny wheels written by hand into a folder (no network, no build backend): the job environments' tests and
bench/env_build.py install from it with ``find_links`` and ``--offline``."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def write_wheel(folder: Path, name: str, version: str, body: str = "", requires: tuple[str, ...] = ()) -> Path:
    """``<name>-<version>-py3-none-any.whl`` whose module ``<name>`` has ``VERSION`` and ``body``."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n{body}".encode(),
        f"{dist}/METADATA": ("Metadata-Version: 2.1\n" f"Name: {name}\n" f"Version: {version}\n"
                             + "".join(f"Requires-Dist: {r}\n" for r in requires)).encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: launch-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [_record_line(n, d) for n, d in files.items()] + [f"{dist}/RECORD,,"]
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for n, d in files.items():
            zf.writestr(n, d)
    return path


def wheel_folder(folder: Path) -> Path:
    """The folder the tests and the benchmark use: launchtiny 1.0 and 2.0, and three small packages."""
    write_wheel(folder, "launchtiny", "1.0")
    write_wheel(folder, "launchtiny", "2.0")
    for name in ("launchalpha", "launchbeta", "launchgamma"):
        write_wheel(folder, name, "0.1", body="def hello():\n    return __name__\n")
    return folder
