"""vLLM's own trainer API, with mx behind it: an FSDP2 trainer refits two real vLLM servers
through ``WeightTransferTrainerFactory`` with ``backend = "mx"``, and nothing is gathered.

Run it (from the repository root)::

    .mx/venv/bin/python examples/vllm_trainer_api.py --report /tmp/vta.json [--ci]

Options: ``--model DIR`` (default ``.mx/models/smollm2-135m``), ``--steps N`` (committed steps,
default 3; ``--ci``: 2), ``--timeout S`` (every wait, default 600), ``--keep`` (keep the work
directory: server logs, dumps, journal). Without ``--ci`` one more step follows the rolled-back
one (the next ``send_weights`` commits again). Exit status 0 only when every check holds.

The trainer code uses vLLM's trainer API only, plus mx's init info:
``WeightTransferTrainerFactory.trainer_init(MxTrainerInitInfo(...), client=
HTTPVLLMWeightSyncClient(url), source=ModuleSource(fsdp_module))`` on every rank, one engine per
server (vLLM's API gives one client per server), and ``engine.send_weights()`` on every rank
after each optimizer step. mx's engine publishes each rank's FSDP2 shards in place; the sender
(rank 0) initialized each server's mx backend through its client, and each step has mx's control
plane refit both servers at once (stage while serving, pause, install, cache reset, read-back,
resume, commit; or roll both back); the second engine's ``send_weights`` finds its server in that
refit and publishes nothing.

Who runs where:

- main: mx's control plane (embedded), two vLLM servers (``examples/engines.py``
  ``VllmServer``, mx's plugin, ``{"backend": "mx"}``, each with a failpoint file), and the checks.
- two trainer processes (slots of ``fsdp:2``, one gloo group, ``examples/llama_fsdp.py``): per
  step one AdamW step, then ``send_weights`` on both engines. Each wraps its own
  ``torch.distributed`` collectives and ``DTensor.full_tensor``/``redistribute`` (independently of
  mx) and counts the bytes handed to them per phase: ``gathered_bytes`` (all-gathers and full
  tensors during ``trainer_init`` and ``send_weights``) must be 0, while training's own FSDP
  all-gathers are counted (``training_gathered_bytes`` > 0: the wrappers see them).

The control plane checks tokens: rank 0's control client presents an orchestrator's token, rank
1's a reader's, both publishers a publisher's (``MxTrainerInitInfo.publisher_token_file`` /
``orchestrator_token_file``), the servers' workers a worker's (``MX_CONTROL_TOKEN_FILE``), the
checker an orchestrator's.

After the first step the trainer restarts: its ranks save their shards and exit, server A's
transfer engine is shut down (vLLM's ``/shutdown_weight_transfer_engine``), and new trainer
processes resume from the saved shards and build their engines again: the sender's init
re-attaches to server B (the same init, nothing changes) and initializes server A again; both
must keep serving the committed version (weight_info, the control plane's resident, admitted,
tokens), and the next version is ``step-2`` (labels continue after a restart).

Checks per committed step: both servers' ``/weight_info`` and the control plane's record name the
version the trainer published; each server's greedy tokens equal a cold start of vLLM on a dump
of the trainer's full weights at that step (the dump's gather is the checker's, outside
``send_weights``; at ``--ci`` size the last committed step only, one vLLM start less) and differ
from the previous step's; one publication and one refit per step
(both engines, both ranks), one install per server. Then one step where server B's install fails
(the mx plugin's failpoint ``install_after:12``): ``send_weights`` raises ``MxRefitError`` on
every rank and engine, and both servers are back on the previous version (weight_info, the
control plane, tokens).

The report: ``versions[]`` (``version_id``, ``outcome``, ``label``, ``train_loss``,
``verified``), ``steps[]`` (``instances[]`` in the harness schema), ``rollback`` (the failed
step), ``all_verified``, ``rollback_verified``, ``gathered_bytes``, ``collective_calls_in_send``,
``training_gathered_bytes``, ``one_publication_per_step``, ``seconds``, ``all_checks_hold``,
``failed_checks`` (``examples/check_report.py vllm_trainer_api``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from engines import COLD_TOKENS, PROMPT, VllmServer, cold_tokens_of
from fsdp_ranks import CollectiveCounter
from procs import Child, commands, free_port, run_example

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUT = "fsdp:2"
INSTANCES = ("vllm-a", "vllm-b")
FAILING = "vllm-b"
"""The server whose install fails in the rollback step."""
LR = 1e-3
BATCH = (1, 17)
MAX_NEW = len(COLD_TOKENS)


# --------------------------------------------------------------------------------------------
# A trainer rank: vLLM's trainer API only (plus mx's init info).


def trainer_main(
    conn: Connection,
    cp_url: str,
    model_dir: str,
    slot: int,
    init_method: str,
    timeout: float,
    tokens: dict[str, str],
    resume: str,
) -> None:
    """One trainer rank. ``tokens``: the token files of its publisher and its control client
    (the control plane checks tokens); ``resume``: a directory of the ranks' saved shards to
    start from (a restarted trainer), or empty (the checkpoint)."""
    counter = CollectiveCounter().install()  # before anything can bind a collective
    import llama_fsdp
    import torch
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from mx.vllm.trainer import MxRefitError, MxTrainerInitInfo

    torch.set_num_threads(1)
    world = int(LAYOUT.split(":")[1])
    with counter.counting("setup"):
        net, opt = llama_fsdp.fsdp_trainer(model_dir, slot, world, init_method, LR)
        if resume:
            # A restart resuming from its own save: each rank's shards, no collective.
            saved = torch.load(os.path.join(resume, f"rank{slot}.pt"))
            with torch.no_grad():
                for n, p in net.named_parameters():
                    p.to_local().copy_(saved[n])
    g = torch.Generator().manual_seed(20261202 + slot + (1000 if resume else 0))
    vocab = net.cfg["vocab_size"]
    batch = torch.randint(0, vocab, BATCH, generator=g)
    engines: dict[str, Any] = {}
    conn.send(("ready", {"slot": slot}))
    try:
        for msg in commands(conn):
            kind = msg[0]
            if kind == "init":
                _, servers = msg
                with counter.counting("send"):
                    for instance, url in servers:
                        info = MxTrainerInitInfo(
                            cp_url,
                            instance,
                            LAYOUT,
                            model_dir,
                            rank=slot,
                            stage_timeout=timeout,
                            publish_timeout=timeout,
                            # Each server generates after the install, before the commit.
                            check_prompt=PROMPT,
                            check_tokens=MAX_NEW,
                            publisher_token_file=tokens["publisher"],
                            orchestrator_token_file=tokens["control"],
                        )
                        engines[instance] = WeightTransferTrainerFactory.trainer_init(
                            info, client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(net)
                        )
                conn.send(("inited", {"engines": list(engines)}))
            elif kind == "step":
                with counter.counting("train"):
                    loss = llama_fsdp.train_step(net, opt, batch)
                sent = {}
                t0 = time.perf_counter()
                with counter.counting("send"):
                    for instance, e in engines.items():
                        t1 = time.perf_counter()
                        error = None
                        try:
                            e.send_weights()
                        except MxRefitError as err:
                            error = {"outcome": err.outcome, "reason": err.reason, "str": str(err)}
                        r = e.last_refit
                        sent[instance] = {
                            "label": e.label,
                            "version_id": e.version_id,
                            "round": e.round,
                            "error": error,
                            "seconds": time.perf_counter() - t1,
                            "refit": None
                            if r is None
                            else {
                                "refit_id": r.refit_id,
                                "outcome": str(r.outcome),
                                "reason": r.reason,
                                "phase_seconds": dict(r.phase_seconds),
                                # Installs per worker in the APPLY phase (a rollback's
                                # install back is in the ROLLBACK phase).
                                "workers": {
                                    w: sum(
                                        c.action == "apply" and c.phase == "APPLY" for c in o.calls
                                    )
                                    for w, o in r.workers.items()
                                },
                                # The post-update check's tokens per worker (CHECK phase).
                                "generated": {
                                    w: next(
                                        (
                                            list(c.tokens)
                                            for c in o.calls
                                            if c.action == "generate" and c.ok
                                        ),
                                        [],
                                    )
                                    for w, o in r.workers.items()
                                },
                                "installs": {
                                    w: [
                                        [c.phase, c.ok, c.version]
                                        for c in o.calls
                                        if c.action == "apply"
                                    ]
                                    for w, o in r.workers.items()
                                },
                                "rollback_installs": {
                                    w: sum(
                                        c.action == "apply" and c.phase == "ROLLBACK"
                                        for c in o.calls
                                    )
                                    for w, o in r.workers.items()
                                },
                            },
                        }
                conn.send(
                    (
                        "stepped",
                        {"loss": loss, "send_s": time.perf_counter() - t0, "engines": sent},
                    )
                )
            elif kind == "save":
                # What a restarted trainer resumes from: this rank's shards (no gather).
                _, out_dir = msg
                os.makedirs(out_dir, exist_ok=True)
                local = {n: p.to_local().detach().clone() for n, p in net.named_parameters()}
                torch.save(local, os.path.join(out_dir, f"rank{slot}.pt"))
                conn.send(("saved", {}))
            elif kind == "dump":
                # The checker's reference (not mx's path): the full weights, gathered.
                _, out_dir = msg
                from safetensors.torch import save_file

                with counter.counting("verify"):
                    full = {n: p.full_tensor() for n, p in net.named_parameters()}
                if slot == 0:
                    os.makedirs(out_dir, exist_ok=True)
                    state = {n: t.detach().contiguous() for n, t in full.items()}
                    save_file(state, os.path.join(out_dir, "model.safetensors"))
                    shutil.copy(os.path.join(model_dir, "config.json"), out_dir)
                del full
                conn.send(("dumped", {}))
            else:
                raise ValueError(f"unknown command {kind!r}")
    finally:
        for e in engines.values():
            e.shutdown()
    conn.send(
        (
            "bye",
            {
                "collectives": counter.summary(),
                "gathered_bytes_in_send": counter.gathered_bytes("send"),
                "collective_calls_in_send": sum(counter.calls["send"].values()),
                "training_gathered_bytes": counter.gathered_bytes("train"),
            },
        )
    )


# --------------------------------------------------------------------------------------------
# The orchestrator and checker (main).


TOKENS = {
    # name: (role, scope): the principals of the control plane, each token in a file of its own.
    "orchestrator": ("orchestrator", ""),
    "reader": ("reader", ""),
    "publisher": ("publisher", "*"),
    "worker": ("worker", "*"),
}


def write_tokens(work: str) -> tuple[str, dict[str, str]]:
    """The control plane's token file and one file per principal (``TOKENS``)."""
    import secrets

    lines, files = [], {}
    for name, (role, scope) in TOKENS.items():
        token = secrets.token_hex(24)
        lines.append(",".join(x for x in (token, role, name, scope) if x))
        files[name] = os.path.join(work, f"{name}.token")
        with open(files[name], "w") as f:
            f.write(token + "\n")
    table = os.path.join(work, "tokens")
    with open(table, "w") as f:
        f.write("\n".join(lines) + "\n")
    return table, files


def _start(work: str, name: str, timeout: float, token_file: str) -> VllmServer:
    fp = os.path.join(work, f"{name}.failpoint")
    s = VllmServer(
        os.path.join(work, name),
        # The server's workers present the worker token (vLLM reads the environment).
        env={"MX_VLLM_FAILPOINT_FILE": fp, "MX_CONTROL_TOKEN_FILE": token_file},
        startup_timeout=timeout,
    )
    s.failpoint = fp  # type: ignore[attr-defined]
    return s


class Run:
    def __init__(
        self, args: argparse.Namespace, work: str, cp: Any, tokens: dict[str, str]
    ) -> None:
        import mx

        self.args, self.work, self.cp, self.tokens_files = args, work, cp, tokens
        self.control = mx.Control(cp.url, timeout=60.0, token_file=tokens["orchestrator"])
        m = args.model
        self.model_dir = m if os.path.isabs(m) else os.path.join(REPO, m)
        self.servers: dict[str, VllmServer] = {}
        self.trainers: list[Child] = []
        self.failed: list[str] = []
        self.tokens = {i: list(COLD_TOKENS) for i in INSTANCES}
        self.resident = {i: "" for i in INSTANCES}
        self.one_round_per_step = True
        self.byes: list[dict[str, Any]] = []  # the trainers' counters, every generation

    def spawn_trainers(self, resume: str = "") -> None:
        """Two trainer ranks (a new gloo group); rank 0's control client is an orchestrator,
        rank 1's a reader; both publish with the publisher token."""
        t, f = self.args.timeout, self.tokens_files
        ctx = mp.get_context("spawn")
        gloo = f"tcp://127.0.0.1:{free_port()}"
        self.trainers = []
        for slot in range(2):
            tokens = {
                "publisher": f["publisher"],
                "control": f["orchestrator" if slot == 0 else "reader"],
            }
            self.trainers.append(
                Child(
                    ctx,
                    f"trainer-{slot}",
                    trainer_main,
                    self.cp.url,
                    self.model_dir,
                    slot,
                    gloo,
                    t,
                    tokens,
                    resume,
                )
            )

    def init_trainers(self) -> None:
        t = self.args.timeout
        for c in self.trainers:
            c.recv("ready", t)
        servers = [(n, self.servers[n].url) for n in INSTANCES]
        for c in self.trainers:
            c.send("init", servers)
        for c in self.trainers:
            c.recv("inited", t)

    def start(self) -> None:
        t = self.args.timeout
        self.spawn_trainers()
        worker = self.tokens_files["worker"]
        with ThreadPoolExecutor(2) as ex:
            futures = {n: ex.submit(_start, self.work, n, t, worker) for n in INSTANCES}
        self.servers.update({n: f.result() for n, f in futures.items() if not f.exception()})
        for f in futures.values():
            f.result()
        for n, s in self.servers.items():
            got = s.generate(PROMPT, MAX_NEW)
            self.check(got == COLD_TOKENS, f"{n}: cold tokens {got} before any refit")
            self.resident[n] = s.call("GET", "/weight_info")[1].get("weight_version")
        self.init_trainers()

    def restart(self) -> dict[str, Any]:
        """The trainer restarts (its processes exit after saving their shards; new ones resume
        from them), and server A's transfer engine is shut down in between
        (``/shutdown_weight_transfer_engine``): the new sender's init re-attaches to server B
        (the same init: nothing changes) and initializes server A again. Both keep serving the
        last committed version, the control plane sees them so (resident, admitted), and the
        next version's label continues the count."""
        t0 = time.perf_counter()
        save = os.path.join(self.work, "resume")
        for c in self.trainers:
            c.send("save", save)
        for c in self.trainers:
            c.recv("saved", self.args.timeout)
        self.byes += self.stop()
        for c in self.trainers:
            c.stop()
        a = self.servers[INSTANCES[0]]
        shut = a.call("POST", "/shutdown_weight_transfer_engine")
        ok = self.check(shut[0] == 200, f"restart: shutdown of {INSTANCES[0]}'s engine: {shut}")
        self.spawn_trainers(resume=save)
        self.init_trainers()
        # Another trainer's init (another instance id) is refused while B follows, and the
        # server's reason reaches the caller (vLLM's HTTP client drops the body).
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        from mx.vllm.trainer import _init_server

        b = self.servers[INSTANCES[1]]
        other = {"control_url": self.cp.url, "instance_id": "intruder", "engine_url": b.url}
        try:
            _init_server(HTTPVLLMWeightSyncClient(b.url), b.url, other)
            refused = "accepted"
        except RuntimeError as e:
            refused = str(e)
        ok &= self.check(
            "differs in instance_id 'vllm-b' -> 'intruder'" in refused,
            f"restart: another init on {INSTANCES[1]}: {refused[:400]}",
        )
        workers = {w.worker_id: w for w in self.control.status().workers}
        servers = {}
        for n in INSTANCES:
            s, w = self.servers[n], workers[f"{n}-tp0"]
            tokens = s.generate(PROMPT, MAX_NEW)
            wv = s.call("GET", "/weight_info")[1].get("weight_version")
            held = wv == self.resident[n] and w.resident_id == self.resident[n]
            ok &= self.check(held, f"restart {n}: weight_info {wv}, control plane {w.resident_id}")
            ok &= self.check(tokens == self.tokens[n], f"restart {n}: tokens {tokens}")
            ok &= self.check(w.connected and w.admitted, f"restart {n}: {w.gate} {w.admission}")
            servers[n] = {
                "engine": "shut down, initialized again" if s is a else "re-attached (same init)",
                "weight_version": wv,
                "control_plane_resident": w.resident_id,
                "admitted": w.admitted,
                "tokens": tokens,
            }
        seconds = time.perf_counter() - t0
        print(f"restart: trainers and {INSTANCES[0]}'s engine in {seconds:.1f} s verified={ok}")
        return {
            "servers": servers,
            "other_init_refused": refused,
            "seconds": seconds,
            "verified": ok,
        }

    def check(self, ok: bool, what: str) -> bool:
        if not ok:
            self.failed.append(what)
            print(f"CHECK FAILED: {what}", flush=True)
        return ok

    def step(self) -> tuple[float, dict[str, dict[str, Any]]]:
        for c in self.trainers:
            c.send("step")
        out = [c.recv("stepped", self.args.timeout) for c in self.trainers]
        return out[0]["loss"], {f"rank{k}": o["engines"] for k, o in enumerate(out)}

    def one_round(self, step: int, sent: dict[str, dict[str, Any]]) -> tuple[bool, str, str]:
        """Every rank and engine: the same label, version and refit, round ``step``; each server
        installed once."""
        rows = [e for rank in sent.values() for e in rank.values()]
        labels = {e["label"] for e in rows}
        vids = {e["version_id"] for e in rows}
        refits = {e["refit"]["refit_id"] if e["refit"] else None for e in rows}
        rounds = {e["round"] for e in rows}
        # Labels count on across the trainer's restart (step-<n>, n the step).
        ok = labels == {f"step-{step}"} and len(vids) == 1 and len(refits) == 1 and rounds == {step}
        ok = self.check(ok, f"step {step}: labels {labels}, versions {vids}, refits {refits}")
        first = rows[0]["refit"]
        applies = first["workers"] if first else {}
        want = {f"{i}-tp0" for i in INSTANCES}
        ok &= self.check(
            set(applies) == want and all(n == 1 for n in applies.values()),
            f"step {step}: one refit of both servers, one install each: {applies}",
        )
        self.one_round_per_step &= ok
        return ok, labels.pop(), vids.pop()

    def committed_step(self, step: int) -> dict[str, Any]:
        t = self.args.timeout
        loss, sent = self.step()
        ok, label, vid = self.one_round(step, sent)
        errors = [e["error"] for r in sent.values() for e in r.values() if e["error"]]
        ok &= self.check(not errors, f"step {step}: send_weights raised {errors}")
        # At --ci size only the last committed step is checked against a cold start (one
        # vLLM start less, ~1-2 minutes of CI); the others by the read-back and the tokens.
        cold: list[int] | None = None
        cached = False
        if not self.args.ci or step == self.args.steps:
            dump = os.path.join(self.work, "dumps", label)
            for c in self.trainers:
                c.send("dump", dump)
            for c in self.trainers:
                c.recv("dumped", t)
            cold, cached, _ = cold_tokens_of(
                "vllm", os.path.join(self.work, "cold"), dump, vid, PROMPT, MAX_NEW, timeout=t
            )
        workers = {w.worker_id: w for w in self.control.status().workers}
        instances = []
        for n in INSTANCES:
            s = self.servers[n]
            tokens = s.generate(PROMPT, MAX_NEW)
            wv = s.call("GET", "/weight_info")[1].get("weight_version")
            resident = workers[f"{n}-tp0"].resident_id
            inst = {
                "id": n,
                "kind": "vllm",
                "engine_layout": "tp:1",
                "source": "mx",
                "tokens": tokens,
                "cold_tokens": cold,
                "tokens_match_cold_start": None if cold is None else tokens == cold,
                "tokens_changed": tokens != self.tokens[n],
                "weight_version": wv,
                "control_plane_resident": resident,
            }
            if cold is not None:
                ok &= self.check(tokens == cold, f"step {step} {n}: tokens {tokens} != cold {cold}")
            ok &= self.check(tokens != self.tokens[n], f"step {step} {n}: tokens did not change")
            ok &= self.check(wv == vid and resident == vid, f"step {step} {n}: {wv}/{resident}")
            self.tokens[n], self.resident[n] = tokens, vid
            instances.append(inst)
        refit = next(iter(sent["rank0"].values()))["refit"]
        # The control plane's post-update check (check_prompt): each server's tokens, before the
        # commit, are the ones it serves after it and a cold start's.
        checked = refit["generated"]
        ok &= self.check(
            checked == {f"{i['id']}-tp0": i["tokens"] for i in instances},
            f"step {step}: the post-update check's tokens {checked}",
        )
        print(
            f"step {step} {label} {vid[:19]}... loss {loss:.4f} refit "
            f"{sum(refit['phase_seconds'].values()):.2f} s; tokens {instances[0]['tokens']} "
            f"cold {cold} (cached {cached}) verified={ok}",
            flush=True,
        )
        return {
            "step": step,
            "label": label,
            "version_id": vid,
            "outcome": refit["outcome"],
            "train_loss": loss,
            "verified": ok,
            "phase_seconds": refit["phase_seconds"],
            "post_update_check": checked,
            "send_s": {r: {i: e["seconds"] for i, e in x.items()} for r, x in sent.items()},
            "instances": instances,
        }

    def failed_step(self, step: int) -> dict[str, Any]:
        """Server B's install fails: both engines raise on both ranks, both servers stay on the
        previous version."""
        fp = self.servers[FAILING].failpoint  # type: ignore[attr-defined]
        with open(fp, "w") as f:
            f.write("install_after:12")
        loss, sent = self.step()
        ok, label, vid = self.one_round(step, sent)
        errors = [e["error"] for r in sent.values() for e in r.values()]
        outcomes = {e["outcome"] if e else None for e in errors}
        ok &= self.check(
            all(errors) and outcomes <= {"ROLLED_BACK", "ABORTED"},
            f"rollback step: send_weights raised on every rank and engine: {outcomes}",
        )
        reason = errors[0]["reason"] if errors[0] else ""
        # The refit's own record: a server installed the failed version, then was installed
        # back to the previous one (ROLLED_BACK, not ABORTED: the fleet had changed).
        refit = next(iter(sent["rank0"].values()))["refit"] or {}
        back_from = sorted(
            w
            for w, calls in refit.get("installs", {}).items()
            if ["APPLY", True, vid] in calls
            and ["ROLLBACK", True, self.resident[w.removesuffix("-tp0")]] in calls
        )
        ok &= self.check(
            f"{INSTANCES[0]}-tp0" in back_from,
            f"rollback: {INSTANCES[0]} installed {vid} then the previous version: "
            f"{refit.get('installs')}",
        )
        ok &= self.check("failpoint" in reason or FAILING in reason, f"reason: {reason}")
        ok &= self.check(not os.path.exists(fp), "the failpoint was not consumed")
        workers = {w.worker_id: w for w in self.control.status().workers}
        servers = {}
        for n in INSTANCES:
            s = self.servers[n]
            tokens = s.generate(PROMPT, MAX_NEW)
            wv = s.call("GET", "/weight_info")[1].get("weight_version")
            resident = workers[f"{n}-tp0"].resident_id
            back = wv == self.resident[n] and resident == self.resident[n]
            ok &= self.check(back, f"rollback {n}: weight_info {wv}, control plane {resident}")
            ok &= self.check(tokens == self.tokens[n], f"rollback {n}: tokens {tokens}")
            paused = s.call("GET", "/is_paused")
            ok &= self.check(paused == (200, {"is_paused": False}), f"{n} paused: {paused}")
            servers[n] = {
                "weight_version": wv,
                "control_plane_resident": resident,
                "tokens": tokens,
            }
        print(f"step {step} {label}: {outcomes} ({reason[:160]}) verified={ok}", flush=True)
        return {
            "step": step,
            "label": label,
            "version_id": vid,
            "outcome": errors[0]["outcome"] if errors[0] else "COMMITTED",
            "reason": reason,
            "train_loss": loss,
            "failing_server": FAILING,
            "raised_on_every_rank_and_engine": all(errors),
            "installed_then_rolled_back": back_from,
            "installs": refit.get("installs"),
            "servers": servers,
            "verified": ok,
        }

    def stop(self) -> list[dict[str, Any]]:
        byes = []
        for c in self.trainers:
            c.send("exit")
        for c in self.trainers:
            byes.append(c.recv("bye", self.args.timeout))
        return byes


def _generations(byes: list[dict[str, Any]]) -> list[tuple[int, int, dict[str, Any]]]:
    """``(trainer generation, rank, counters)`` of the trainers' goodbyes, two per generation."""
    return [(i // 2 + 1, i % 2, b) for i, b in enumerate(byes)]


def run(args: argparse.Namespace, work: str) -> dict[str, Any]:
    import mx

    started = time.perf_counter()
    table, tokens = write_tokens(work)
    with mx.ControlPlane(journal=os.path.join(work, "journal.jsonl"), tokens=table) as cp:
        r = Run(args, work, cp, tokens)
        try:
            r.start()
            print(f"started in {time.perf_counter() - started:.1f} s", flush=True)
            versions = [r.committed_step(1)]
            restart = r.restart()
            versions += [r.committed_step(k) for k in range(2, args.steps + 1)]
            rollback = r.failed_step(args.steps + 1)
            if not args.ci:
                versions.append(r.committed_step(args.steps + 2))
            r.byes += r.stop()
            ranks = {f"gen{g}-rank{k}": b for g, k, b in _generations(r.byes)}
        finally:
            for c in r.trainers:
                c.stop()
            for s in r.servers.values():
                s.stop()
    gathered = sum(b["gathered_bytes_in_send"] for b in ranks.values())
    calls = sum(b["collective_calls_in_send"] for b in ranks.values())
    training = sum(b["training_gathered_bytes"] for b in ranks.values())
    r.check(gathered == 0, f"gathered_bytes {gathered} in trainer_init/send_weights")
    r.check(calls == 0, f"{calls} collective calls in trainer_init/send_weights")
    r.check(training > 0, "the wrappers saw no all-gather in training (FSDP2 gathers there)")
    steps = [{k: v for k, v in x.items() if k != "send_s"} for x in versions]
    return {
        "model": os.path.relpath(r.model_dir, REPO),
        "trainer_layout": LAYOUT,
        "servers": list(INSTANCES),
        "api": "vllm WeightTransferTrainerFactory + HTTPVLLMWeightSyncClient + ModuleSource",
        "versions": [
            {k: v[k] for k in ("label", "version_id", "outcome", "train_loss", "verified")}
            for v in versions
        ],
        "steps": steps,
        "rollback": rollback,
        "restart": restart,
        "all_verified": all(v["verified"] for v in versions) and restart["verified"],
        "rollback_verified": rollback["verified"],
        "one_publication_per_step": r.one_round_per_step,
        "gathered_bytes": gathered,
        "collective_calls_in_send": calls,
        "training_gathered_bytes": training,
        "trainer_collectives": {k: b["collectives"] for k, b in ranks.items()},
        "send_s": [v["send_s"] for v in versions],
        "seconds": time.perf_counter() - started,
        "failed_checks": r.failed,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", required=True, help="where to write the JSON report")
    ap.add_argument("--model", default=".mx/models/smollm2-135m", help="HF checkpoint directory")
    ap.add_argument("--steps", type=int, default=3, help="committed steps (>= 2)")
    ap.add_argument(
        "--ci",
        action="store_true",
        help="CI's size: 2 committed steps, the last one checked against a cold start",
    )
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds, for every wait")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    if args.ci:
        args.steps = 2
    if args.steps < 2:
        ap.error("--steps must be >= 2")
    hold = ("all_verified", "rollback_verified", "one_publication_per_step")
    return run_example("vllm_trainer_api", run, args, REPO, hold, width=8)


if __name__ == "__main__":
    sys.exit(main())
