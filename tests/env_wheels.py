"""Tiny wheels written by hand into a folder (no network, no build backend): the job environments' tests and
bench/env_build.py install from it with ``find_links`` and ``--offline``."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import zipfile
from pathlib import Path
from typing import Iterator


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


@contextlib.contextmanager
def slow_index(folder: Path, delay: float) -> Iterator[str]:
    """A package index (PEP 503 pages) on loopback serving ``folder``'s wheels, each project page ``delay`` s
    late: a build that takes that long, as on a slow network. Yields its ``/simple`` URL."""
    import http.server
    import threading
    import time

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's names)
            self._answer(body_too=True)

        def do_HEAD(self) -> None:  # noqa: N802 (uv asks a wheel's size first)
            self._answer(body_too=False)

        def _answer(self, body_too: bool) -> None:
            parts = [p for p in self.path.split("?")[0].split("/") if p]
            if parts[:1] == ["files"] and len(parts) == 2 and (folder / parts[1]).is_file():
                body, kind = (folder / parts[1]).read_bytes(), "application/octet-stream"
            elif parts[:1] == ["simple"] and len(parts) == 2:
                if body_too:
                    time.sleep(delay)
                project = parts[1].lower().replace("_", "-")
                links = "".join(
                    f'<a href="/files/{w.name}#sha256={hashlib.sha256(w.read_bytes()).hexdigest()}">{w.name}</a>\n'
                    for w in sorted(folder.glob("*.whl")) if w.name.split("-")[0].lower().replace("_", "-") == project)
                body, kind = f"<html><body>\n{links}</body></html>\n".encode(), "text/html"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if body_too:
                self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    finally:
        server.shutdown()
        server.server_close()
