"""verl 0.9.1's checkpoint engine with mx behind it: two FSDP2 actor ranks sync a real vLLM
through ``CheckpointEngineRegistry``'s backend ``"mx"`` (:mod:`mx.verl`), in verl's manager
order, with verl's own installer on the rollout side, and nothing is gathered.

Run it (from the repository root)::

    .mx/venv/bin/python examples/verl_engine.py --report /tmp/verl.json [--ci]

Options: ``--model DIR`` (default ``.mx/models/smollm2-135m``), ``--steps N`` (committed
syncs, default 3; ``--ci``: 2), ``--bucket-mb M`` (verl's ``update_weights_bucket_megabytes``,
default 128), ``--timeout S`` (every wait, default 600), ``--keep`` (keep the work directory).
Without ``--ci`` one more sync follows the failed one (the next ``prepare`` releases what the
failed sync held, and a new version goes through). Exit status 0 only when every check holds.

What is verl's own code here, and what was replaced (verl's manager runs on Ray with GPU
pools; this machine has neither):

- verl's, unchanged: ``import_external_libs("mx.verl")`` + ``CheckpointEngineRegistry.new("mx",
  is_master=..., bucket_size=..., **engine_kwargs)`` on each actor rank, as
  ``engine_workers.py`` builds it; the actor's weights from verl's FSDP engine
  ``FSDPEngine.get_per_tensor_param`` (its real method, lazy ``param.to(device).full_tensor()``
  generator and ``unfuse_moe_params``) over the trainer's FSDP2 module; the rollout side is a
  real ``CheckpointEngineWorker`` built from a ``RolloutConfig`` (``checkpoint_engine.backend=
  mx``, ``custom_backend_module=mx.verl``, ``engine_kwargs.mx``), whose ``update_weights``
  hands ``receive_weights()`` to ``ServerAdapter.update_weights`` (verl's method:
  ``BucketedWeightSender`` over ZMQ + shared memory), received in the vLLM worker by verl's
  ``vLLMColocateWorkerExtension.update_weights_from_ipc`` (``BucketedWeightReceiver``,
  ``model.load_weights`` per bucket); the build_topology / length asserts / init /
  update / finalize sequence of ``CheckpointEngineManager.update_weights`` and
  ``build_process_group``.
- replaced: Ray (the worker groups' ``execute_checkpoint_engine`` calls are pipe messages to
  the actor processes and direct calls on the rollout worker; ``ray.get`` is waiting for their
  answers); the FSDP engine object (a stand-in carrying the module and the config fields
  ``get_per_tensor_param`` reads: no LoRA, no offload, no QAT, model type ``llama``; the
  trainer is ``examples/llama_fsdp.py``, HF parameter names, over gloo); verl's accelerator
  platform (``examples/verl_cpu.py``: a ``cpu`` platform through verl's ``PlatformRegistry``,
  so ``get_device_id()`` is ``"cpu"`` and verl takes its shared-memory path); the
  ServerAdapter's Ray plumbing (its ``__init__`` reads Ray's job id and actor handles: the
  subclass here sets the same fields, and ``_execute_method`` posts vLLM's ``/collective_rpc``
  instead of a Ray actor call); the manager's replica calls (``abort_all_requests`` /
  ``resume_generation``: vLLM's ``/pause?mode=abort`` / ``/resume``; ``clear_kv_cache``:
  ``/reset_prefix_cache``; ``release_kv_cache`` / ``resume_kv_cache``: not done, vLLM's CPU
  backend keeps its KV cache); verl's worker extension runs inside vLLM's layerwise reload
  (``examples/verl_vllm_ext.py``: vLLM's CPU backend repacks Linear weights, so a bare
  ``load_weights`` has nowhere to write).

Checks per committed sync: the sha256 of every tensor verl's installer handed vLLM's
``load_weights`` (recorded inside the vLLM worker) equals that of the trainer's full tensor at
that step, all 272 of them, and the parameters vLLM keeps in their own memory on CPU
(embeddings, norms) read back equal too; the trainer's full tensors are gathered for this
OUTSIDE the sync window (the ``verify`` phase, ``full_tensor()`` on both ranks); greedy tokens
change; the rollout staged the version every actor rank published. Then a failed sync: after
both actor ranks published, rank 1 writes into its published shard (in place, before the
pull), so the rollout's pull does not verify: ``receive_weights`` raises ``MxReceiveError``
(``DataLoss``) from ``CheckpointEngineWorker.update_weights`` before verl's adapter opens its
transfer, and vLLM is shown on the previous sync's bytes (no further ``load_weights``, resident
digests and tokens as before).

Each actor process wraps its own ``torch.distributed`` collectives and ``DTensor.full_tensor``
/ ``redistribute`` (``examples/fsdp_ranks.py``, independently of mx) and counts bytes per
phase: ``gathered_bytes`` over the sync windows (prepare, init_process_group,
get_per_tensor_param, send_weights, finalize) must be 0; training's own FSDP2 all-gathers are
counted (``training_gathered_bytes`` > 0).

The report: ``versions[]`` (``version_id``, ``outcome`` ``COMMITTED``: the sync completed on
every rollout rank and verified, ``label``, ``global_steps``, ``train_loss``, ``verified``),
``syncs[]`` (per sync: timings, metrics, digests compared), ``rollback``, ``all_verified``,
``rollback_verified``, ``gathered_bytes``, ``collective_calls_in_sync``,
``training_gathered_bytes``, ``replaced``, ``seconds``, ``all_checks_hold``, ``failed_checks``
(``examples/check_report.py verl_engine``).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

from engines import PROMPT, VllmServer
from fsdp_ranks import CollectiveCounter, sha256
from procs import Child, commands, free_port, run_example

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 2
LAYOUT = f"fsdp:{WORLD}"
LR = 1e-3
BATCH = (1, 17)
MAX_NEW = 8
EXTENSION = "verl_vllm_ext.CpuColocateWorkerExtension"
CORRUPTED = "model.norm.weight"
"""The tensor whose published shard rank 1 writes in the failed sync."""

REPLACED = {
    "ray": "worker groups' execute_checkpoint_engine / update_weights: pipe messages to the "
    "actor processes, direct calls on the rollout CheckpointEngineWorker; ray.get: waiting",
    "fsdp_engine": "FSDPEngine object: a stand-in with .module (the FSDP2 llama of "
    "examples/llama_fsdp.py) and the config fields get_per_tensor_param reads; the method is "
    "verl's own",
    "platform": "verl's accelerator platform: a cpu platform through verl's PlatformRegistry "
    "(examples/verl_cpu.py)",
    "server_adapter": "ServerAdapter.__init__ (Ray job id, actor handles) and _execute_method "
    "(Ray actor call -> vLLM POST /collective_rpc); update_weights is verl's own",
    "replica_calls": "abort_all_requests/resume_generation -> vLLM /pause?mode=abort, /resume; "
    "clear_kv_cache -> /reset_prefix_cache; release/resume_kv_cache: not done (vLLM CPU)",
    "worker_extension": "verl's vLLMColocateWorkerExtension.update_weights_from_ipc runs inside "
    "vLLM's layerwise reload (CPU repacks Linear weights) with a digest probe "
    "(examples/verl_vllm_ext.py)",
}


def engine_kwargs(cp_url: str, model_dir: str, timeout: float) -> dict[str, Any]:
    """``checkpoint_engine.engine_kwargs.mx``, as a verl config would give them."""
    return {
        "control_url": cp_url,
        "model": model_dir,
        "layout": LAYOUT,
        "label_prefix": "verl",
        "publish_timeout": timeout,
        "stage_timeout": timeout,
    }


# --------------------------------------------------------------------------------------------
# An actor rank: verl's engine built as engine_workers.py builds it, over an FSDP2 trainer.


def _fsdp_engine(module: Any) -> Any:
    """The fields of verl's ``FSDPEngine`` that ``get_per_tensor_param`` reads (the rest of the
    engine, its configs and device placement, is not built here)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        module=module,
        model_config=SimpleNamespace(lora={}, hf_config=SimpleNamespace(model_type="llama")),
        _uses_fsdp2_cpu_offload_policy=False,
        _is_offload_param=False,
        _qat_enabled=False,
    )


def actor_main(
    conn: Connection,
    model_dir: str,
    rank: int,
    init_method: str,
    kwargs: dict[str, Any],
    bucket_size: int,
) -> None:
    counter = CollectiveCounter().install()  # before anything can bind a collective
    import llama_fsdp
    import torch
    import verl_cpu  # noqa: F401  (verl's platform: cpu)
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    torch.set_num_threads(1)
    with counter.counting("setup"):
        net, opt = llama_fsdp.fsdp_trainer(model_dir, rank, WORLD, init_method, LR)
        # As engine_workers.py builds the actor's checkpoint engine.
        import_external_libs("mx.verl")
        engine = CheckpointEngineRegistry.new(
            "mx", is_master=(torch.distributed.get_rank() == 0), bucket_size=bucket_size, **kwargs
        )
    fsdp = _fsdp_engine(net)
    g = torch.Generator().manual_seed(20261207 + rank)
    batch = torch.randint(0, net.cfg["vocab_size"], BATCH, generator=g)
    conn.send(("ready", {"rank": rank, "engine": type(engine).__name__, "role": engine.role}))
    try:
        for msg in commands(conn):
            kind = msg[0]
            if kind == "train":
                with counter.counting("train"):
                    loss = llama_fsdp.train_step(net, opt, batch)
                conn.send(("trained", {"loss": loss}))
            elif kind == "call":  # the worker group's execute_checkpoint_engine(method, **kw)
                _, method, kw = msg
                with counter.counting("sync"):
                    out = getattr(engine, method)(**kw)
                conn.send(("called", {"result": out}))
            elif kind == "update_weights":  # engine_workers.py's update_weights, mode "mx"
                _, global_steps = msg
                t0 = time.perf_counter()
                with counter.counting("sync"):
                    per_tensor_param, _ = FSDPEngine.get_per_tensor_param(fsdp)
                    metrics = asyncio.run(
                        engine.send_weights(per_tensor_param, global_steps=global_steps)
                    )
                conn.send(
                    (
                        "updated",
                        {
                            "metrics": metrics,
                            "label": engine.label,
                            "version_id": engine.version_id,
                            "seconds": time.perf_counter() - t0,
                        },
                    )
                )
            elif kind == "full_digests":
                # The checker's reference, OUTSIDE the sync window: the full tensors, gathered.
                with counter.counting("verify"):
                    full = {n: p.full_tensor() for n, p in net.named_parameters()}
                digests = {n: sha256(t) for n, t in full.items()} if rank == 0 else {}
                del full
                conn.send(("digests", {"digests": digests}))
            elif kind == "write_published_shard":
                # The failed sync: this rank writes its shard after publishing it in place.
                p = dict(net.named_parameters())[CORRUPTED]
                with torch.no_grad():
                    p.to_local().add_(1.0)
                conn.send(("written", {"tensor": CORRUPTED, "rank": rank}))
            else:
                raise ValueError(f"unknown command {kind!r}")
    finally:
        engine.close()
    conn.send(
        (
            "bye",
            {
                "collectives": counter.summary(),
                "gathered_bytes_in_sync": counter.gathered_bytes("sync"),
                "collective_calls_in_sync": sum(counter.calls["sync"].values()),
                "training_gathered_bytes": counter.gathered_bytes("train"),
            },
        )
    )


# --------------------------------------------------------------------------------------------
# The rollout side (main): a real CheckpointEngineWorker and verl's ServerAdapter over HTTP.


def http_server_adapter(server: VllmServer, zmq_handle: str, bucket_mb: int) -> Any:
    """verl's vLLM ``ServerAdapter`` with its Ray plumbing replaced: the fields its
    ``update_weights`` reads, and ``_execute_method`` as vLLM's ``POST /collective_rpc``."""
    from types import SimpleNamespace

    from verl.utils.device import is_support_ipc
    from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

    class HttpServerAdapter(ServerAdapter):
        def __init__(self) -> None:  # not ServerAdapter's: it needs Ray
            self.config = SimpleNamespace(
                checkpoint_engine=SimpleNamespace(update_weights_bucket_megabytes=bucket_mb)
            )
            self.zmq_handle = zmq_handle
            self.use_shm = not is_support_ipc()
            self._has_server = False  # its Ray-only calls (clear_kv_cache...) are main's
            self.replica_rank = 0
            self.rollout_rank = 0
            self.rpc: list[Any] = []

        async def _execute_method(
            self,
            method: str,
            non_block: bool = False,
            timeout: float | None = None,
            args: tuple = (),
            kwargs: dict | None = None,
        ) -> Any:
            body = {"method": method, "args": list(args), "kwargs": kwargs or {}}

            def call() -> Any:
                status, out = server.call("POST", "/collective_rpc", body, timeout=600)
                self.rpc.append({"method": method, "status": status})
                if status != 200:
                    raise RuntimeError(f"{method}: HTTP {status}: {str(out)[:500]}")
                return out

            fut = asyncio.get_running_loop().run_in_executor(None, call)
            return fut if non_block else await fut

    return HttpServerAdapter()


def rollout_worker(server: VllmServer, kwargs: dict[str, Any], bucket_mb: int, job: str) -> Any:
    """A real ``CheckpointEngineWorker`` built from a ``RolloutConfig`` (so verl imports
    ``custom_backend_module`` and builds the engine from ``engine_kwargs.mx`` itself)."""
    from verl.checkpoint_engine.base import CheckpointEngineWorker
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig

    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    config = RolloutConfig(
        name="vllm",
        checkpoint_engine=CheckpointEngineConfig(
            backend="mx",
            custom_backend_module="mx.verl",
            update_weights_bucket_megabytes=bucket_mb,
            engine_kwargs={"mx": kwargs},
        ),
    )
    handle = f"ipc:///tmp/rl-colocate-zmq-{job}-replica-0-rank-0.sock"
    return CheckpointEngineWorker(
        config, None, server_adapter=http_server_adapter(server, handle, bucket_mb)
    )


# --------------------------------------------------------------------------------------------
# The orchestrator and checker (main).


class Run:
    def __init__(self, args: argparse.Namespace, work: str, cp: Any) -> None:
        self.args, self.work, self.cp = args, work, cp
        m = args.model
        self.model_dir = m if os.path.isabs(m) else os.path.join(REPO, m)
        self.kwargs = engine_kwargs(cp.url, self.model_dir, args.timeout)
        self.server: VllmServer | None = None
        self.rollout: Any = None
        self.actors: list[Child] = []
        self.failed: list[str] = []
        self.tokens: list[int] = []
        self.readback: dict[str, Any] = {}
        self.job = f"mxverl{os.getpid()}"

    def check(self, ok: bool, what: str) -> bool:
        if not ok:
            self.failed.append(what)
            print(f"CHECK FAILED: {what}", flush=True)
        return ok

    def start(self) -> None:
        t = self.args.timeout
        ctx = mp.get_context("spawn")
        gloo = f"tcp://127.0.0.1:{free_port()}"
        bucket = self.args.bucket_mb << 20
        for rank in range(WORLD):
            self.actors.append(
                Child(
                    ctx,
                    f"actor-{rank}",
                    actor_main,
                    self.model_dir,
                    rank,
                    gloo,
                    self.kwargs,
                    bucket,
                )
            )
        path = os.pathsep.join(
            [os.path.join(REPO, "examples")]
            + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        self.server = VllmServer(
            os.path.join(self.work, "vllm"),
            model=self.model_dir,
            env={
                "PYTHONPATH": path,
                "VERL_PLATFORM": "cpu",
                "VERL_RAY_JOB_ID": self.job,
                "VERL_REPLICA_RANK": "0",
            },
            extra_args=["--worker-extension-cls", EXTENSION],
            startup_timeout=t,
        )
        for c in self.actors:
            c.recv("ready", t)
        self.rollout = rollout_worker(self.server, self.kwargs, self.args.bucket_mb, self.job)
        self.tokens = self.server.generate(PROMPT, MAX_NEW)
        self.readback = self.server.worker_rpc("mx_verl_readback")[0]

    # The worker groups' calls (Ray's, replaced).
    def actors_call(self, method: str, per_rank: list[dict[str, Any]] | None = None) -> list[Any]:
        for k, c in enumerate(self.actors):
            c.send("call", method, per_rank[k] if per_rank else {})
        return [c.recv("called", self.args.timeout)["result"] for c in self.actors]

    def rollout_call(self, method: str, **kw: Any) -> Any:
        from verl.checkpoint_engine.base import CheckpointEngineWorker

        return CheckpointEngineWorker.execute_checkpoint_engine(self.rollout, method, **kw)

    def build_process_group(self) -> dict[str, Any]:
        """``CheckpointEngineManager.build_process_group``: prepare on all, the backend's
        build_topology, the manager's length asserts, init_process_group on all."""
        from verl.checkpoint_engine.base import CheckpointEngineRegistry

        backend_cls = CheckpointEngineRegistry.get("mx")
        metadata = self.actors_call("prepare") + [self.rollout_call("prepare")]
        actor_kw, rollout_kw = backend_cls.build_topology(WORLD, 1, metadata)
        for k, v in actor_kw.items():
            assert len(v) == WORLD, f"actor_wg_kwargs[{k}] must have length of {WORLD}"
        for k, v in rollout_kw.items():
            assert len(v) == 1, f"rollout_kwargs[{k}] must have length of 1"
        self.actors_call(
            "init_process_group", [{k: v[r] for k, v in actor_kw.items()} for r in range(WORLD)]
        )
        self.rollout_call("init_process_group", **{k: v[0] for k, v in rollout_kw.items()})
        return {"metadata": metadata, "sync": actor_kw["sync"][0]}

    def train(self) -> float:
        for c in self.actors:
            c.send("train")
        return [c.recv("trained", self.args.timeout)["loss"] for c in self.actors][0]

    def actors_update(self, global_steps: int) -> list[dict[str, Any]]:
        for c in self.actors:
            c.send("update_weights", global_steps)
        return [c.recv("updated", self.args.timeout) for c in self.actors]

    def rollout_update(self, global_steps: int) -> tuple[float, BaseException | None]:
        """``CheckpointEngineWorker.update_weights`` (verl's): receive_weights into
        ServerAdapter.update_weights."""
        t0 = time.perf_counter()
        try:
            asyncio.run(self.rollout.update_weights(global_steps=global_steps))
        except Exception as e:
            return time.perf_counter() - t0, e
        return time.perf_counter() - t0, None

    def full_digests(self) -> dict[str, str]:
        for c in self.actors:
            c.send("full_digests")
        return [c.recv("digests", self.args.timeout)["digests"] for c in self.actors][0]

    def pause(self) -> None:
        assert self.server is not None
        status, body = self.server.call("POST", "/pause?mode=abort")
        self.check(status == 200, f"/pause?mode=abort: {status} {body}")

    def resume(self) -> None:
        assert self.server is not None
        status, body = self.server.call("POST", "/resume")
        self.check(status == 200, f"/resume: {status} {body}")

    def committed_sync(self, global_steps: int) -> dict[str, Any]:
        assert self.server is not None
        loss = self.train()
        rpc_before = len(self.rollout.server_adapter.rpc)
        t0 = time.perf_counter()
        self.pause()  # the manager's abort_replicas
        topo = self.build_process_group()
        for c in self.actors:  # actor_wg.update_weights ...
            c.send("update_weights", global_steps)
        rollout_s, err = self.rollout_update(global_steps)  # ... + rollout.update_weights
        sent = [c.recv("updated", self.args.timeout) for c in self.actors]
        self.actors_call("finalize")
        self.rollout_call("finalize")
        self.server.call("POST", "/reset_prefix_cache")  # the adapter's clear_kv_cache
        self.resume()  # the manager's resume_generation_replicas
        sync_s = time.perf_counter() - t0
        engine = self.rollout.checkpoint_engine
        ok = self.check(err is None, f"sync {global_steps}: rollout update raised {err!r}")
        labels = {s["label"] for s in sent} | {engine.label}
        vids = {s["version_id"] for s in sent} | {engine.version_id}
        ok &= self.check(
            len(labels) == 1 and len(vids) == 1,
            f"sync {global_steps}: labels {labels}, versions {vids} across actors and rollout",
        )
        label, vid = sent[0]["label"], sent[0]["version_id"]
        # Verification, outside the sync window.
        ref = self.full_digests()
        rb = self.server.worker_rpc("mx_verl_readback")[0]
        loaded = rb["loaded"]
        same = sorted(n for n in ref if loaded.get(n) == ref[n])
        ok &= self.check(
            len(same) == len(ref) == len(loaded),
            f"sync {global_steps}: {len(same)} of {len(ref)} tensors vLLM loaded equal the "
            f"trainer's ({len(loaded)} loaded); differ: "
            f"{sorted(set(ref) - set(same))[:3]}",
        )
        resident = rb["resident"]
        res_same = sorted(n for n in resident if ref.get(n) == resident[n])
        ok &= self.check(
            len(res_same) == len(resident) > 0,
            f"sync {global_steps}: {len(res_same)} of {len(resident)} resident parameters read "
            "back equal the trainer's",
        )
        ok &= self.check(
            rb["updates"] == self.readback.get("updates", 0) + 1,
            f"sync {global_steps}: {rb['updates']} updates (one per sync)",
        )
        tokens = self.server.generate(PROMPT, MAX_NEW)
        ok &= self.check(tokens != self.tokens, f"sync {global_steps}: tokens did not change")
        self.tokens, self.readback = tokens, rb
        print(
            f"sync {global_steps} {label} {vid[:19]}... loss {loss:.4f} sync {sync_s:.2f} s "
            f"(rollout {rollout_s:.2f} s); {len(same)}/{len(ref)} tensors verified; "
            f"tokens {tokens} verified={ok}",
            flush=True,
        )
        return {
            "global_steps": global_steps,
            "label": label,
            "version_id": vid,
            "outcome": "COMMITTED" if ok else "FAILED",
            "train_loss": loss,
            "verified": ok,
            "sync": topo["sync"],
            "sync_s": sync_s,
            "rollout_update_s": rollout_s,
            "actor_send_s": [s["seconds"] for s in sent],
            "actor_metrics": [s["metrics"] for s in sent],
            "rollout_metrics": dict(engine.last_metrics),
            "tensors_verified": len(same),
            "tensors": len(ref),
            "resident_verified": len(res_same),
            "tokens": tokens,
            "vllm_calls": self.rollout.server_adapter.rpc[rpc_before:],
        }

    def failed_sync(self, global_steps: int) -> dict[str, Any]:
        """Rank 1 writes its published shard before the pull: the rollout's pull does not
        verify, receive_weights raises before anything reaches verl's installer."""
        from mx.verl._engine import MxReceiveError

        assert self.server is not None
        loss = self.train()
        self.pause()
        self.build_process_group()
        sent = self.actors_update(global_steps)  # both ranks published (READY)
        self.actors[1].send("write_published_shard")
        written = self.actors[1].recv("written", self.args.timeout)
        rpc_before = len(self.rollout.server_adapter.rpc)
        _, err = self.rollout_update(global_steps)
        # verl's manager raises here (ray.get) and does not finalize; generation resumes.
        self.resume()
        ok = self.check(
            isinstance(err, MxReceiveError) and err.code == "DataLoss",
            f"failed sync: receive raised {err!r}, not MxReceiveError(DataLoss)",
        )
        reason = str(err)
        ok &= self.check(CORRUPTED in reason, f"failed sync: the error names {CORRUPTED}: {reason}")
        rpc = self.rollout.server_adapter.rpc[rpc_before:]
        ok &= self.check(not rpc, f"failed sync: the adapter called vLLM: {rpc}")
        rb = self.server.worker_rpc("mx_verl_readback")[0]
        ok &= self.check(
            rb["updates"] == self.readback["updates"] and rb["loaded"] == self.readback["loaded"],
            f"failed sync: vLLM loaded weights ({rb['updates']} updates)",
        )
        ok &= self.check(
            rb["resident"] == self.readback["resident"],
            "failed sync: vLLM's resident parameters changed",
        )
        tokens = self.server.generate(PROMPT, MAX_NEW)
        ok &= self.check(tokens == self.tokens, f"failed sync: tokens {tokens} != {self.tokens}")
        staged = self.rollout.checkpoint_engine._puller.versions.staged
        ok &= self.check(staged is None, f"failed sync: {staged} left staged")
        paused = self.server.call("GET", "/is_paused")
        ok &= self.check(paused == (200, {"is_paused": False}), f"paused: {paused}")
        print(f"sync {global_steps} failed as planned: {reason[:200]} verified={ok}", flush=True)
        return {
            "global_steps": global_steps,
            "label": sent[0]["label"],
            "version_id": sent[0]["version_id"],
            "outcome": "ABORTED",
            "error": type(err).__name__ if err else None,
            "code": getattr(err, "code", None),
            "reason": reason,
            "train_loss": loss,
            "written": written,
            "vllm_calls_after_failure": rpc,
            "tokens": tokens,
            "vllm_updates": rb["updates"],
            "verified": ok,
        }

    def stop(self) -> dict[str, Any]:
        for c in self.actors:
            c.send("exit")
        return {f"rank{k}": c.recv("bye", self.args.timeout) for k, c in enumerate(self.actors)}

    def close(self) -> None:
        if self.rollout is not None:
            self.rollout.checkpoint_engine.close()
        for c in self.actors:
            c.stop()
        if self.server is not None:
            self.server.stop()


def run(args: argparse.Namespace, work: str) -> dict[str, Any]:
    import verl_cpu  # noqa: F401  (before verl asks for a platform)

    import mx

    started = time.perf_counter()
    with mx.ControlPlane(journal=os.path.join(work, "journal.jsonl")) as cp:
        r = Run(args, work, cp)
        try:
            r.start()
            print(f"started in {time.perf_counter() - started:.1f} s", flush=True)
            versions = [r.committed_sync(k) for k in range(1, args.steps + 1)]
            rollback = r.failed_sync(args.steps + 1)
            if not args.ci:
                versions.append(r.committed_sync(args.steps + 2))
            ranks = r.stop()
        finally:
            r.close()
    gathered = sum(b["gathered_bytes_in_sync"] for b in ranks.values())
    calls = sum(b["collective_calls_in_sync"] for b in ranks.values())
    training = sum(b["training_gathered_bytes"] for b in ranks.values())
    r.check(gathered == 0, f"gathered_bytes {gathered} in the sync windows")
    r.check(calls == 0, f"{calls} collective calls in the sync windows")
    r.check(training > 0, "the wrappers saw no all-gather in training (FSDP2 gathers there)")
    keys = ("label", "version_id", "outcome", "global_steps", "train_loss", "verified")
    return {
        "model": os.path.relpath(r.model_dir, REPO),
        "actor_layout": LAYOUT,
        "rollout": "vllm tp:1 (verl's vLLMColocateWorkerExtension)",
        "bucket_mb": args.bucket_mb,
        "versions": [{k: v[k] for k in keys} for v in versions],
        "syncs": versions,
        "rollback": rollback,
        "all_verified": all(v["verified"] for v in versions),
        "rollback_verified": rollback["verified"],
        "gathered_bytes": gathered,
        "collective_calls_in_sync": calls,
        "training_gathered_bytes": training,
        "trainer_collectives": {k: b["collectives"] for k, b in ranks.items()},
        "replaced": REPLACED,
        "seconds": time.perf_counter() - started,
        "failed_checks": r.failed,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", required=True, help="where to write the JSON report")
    ap.add_argument("--model", default=".mx/models/smollm2-135m", help="HF checkpoint directory")
    ap.add_argument("--steps", type=int, default=3, help="committed syncs (>= 2)")
    ap.add_argument("--bucket-mb", type=int, default=128, help="update_weights_bucket_megabytes")
    ap.add_argument("--ci", action="store_true", help="CI's size: 2 committed syncs")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds, for every wait")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    if args.ci:
        args.steps = 2
    if args.steps < 2:
        ap.error("--steps must be >= 2")
    hold = ("all_verified", "rollback_verified")
    return run_example("verl_engine", run, args, REPO, hold, width=16)


if __name__ == "__main__":
    sys.exit(main())
