"""An HTTP inference server run on 127.0.0.1 for a check or a benchmark (vLLM, llama.cpp): started, waited for on
its /health, and stopped with its whole process group on exit. Standard library only: it also runs in a peer's
own venv."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 600) -> str:
    """GET `url`, or POST `body` to it as JSON; the response's text."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read().decode()


class Server:
    """`cmd` serving on 127.0.0.1:`port` (its output in `log`), in its own process group, stopped on exit."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path, timeout: float):
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        start = time.perf_counter()
        while not self.healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}; see {log}")
            if time.perf_counter() - start > timeout:
                self.stop()
                raise RuntimeError(f"{name} not ready after {timeout:.0f} s; see {log}")
            time.sleep(1)
        self.startup_seconds = time.perf_counter() - start

    def healthy(self) -> bool:
        try:
            http(self.url + "/health", timeout=5)
            return True
        except OSError:  # refused, reset or 503 while the model loads
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
