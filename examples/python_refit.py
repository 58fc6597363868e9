"""Live refit from Python: a torch trainer (FSDP, 2 ranks) feeds two inference engines (TP 3).

What it shows: mx used from Python exactly as a trainer and an engine would use it. Trainer
ranks take real optimizer steps in place on their shards of a real checkpoint and publish each
step as a policy version straight from their parameter memory (no copy); engine processes hold
the model in their own tensor-parallel layout and are moved to each version by the control
plane (stage over NIXL, verify, apply in place, commit); every byte the engines end up with is
compared with the trainers' own tensors, the engines' tensors never move, and a rollback
restores the previous version from the retained copy.

Run it (from the repository root)::

    .mx/venv/bin/python examples/python_refit.py --report /tmp/r.json

Options: ``--model DIR`` (an HF checkpoint directory with safetensors, relative paths from the
repository root; default ``.mx/models/smollm2-135m``, see scripts/setup-models.sh), ``--steps N``
(default 3), ``--timeout S`` (every wait, default 300), ``--keep`` (keep the temporary directory:
journal and reference files). Exit status 0 only when every check holds.

The processes (``multiprocessing``, ``spawn`` start method; they talk over Pipes):

- main, the orchestrator: runs the control plane (``mx.ControlPlane``, with its journal in a
  temporary directory) and its client (``mx.Control``); per version it declares the version,
  tells the trainers to step and publish, refits the engines to it (``Control.refit``: STAGE,
  PREPARE, APPLY, VERIFY, RESUME, COMMIT) and asks the engines to check their bytes. Then it
  refits the engines back to the previous version (a rollback: they restore it from their
  retained copy, nothing is pulled), checks again, and writes the report.
- trainer 0 and trainer 1 (slots of trainer layout ``fsdp:2``, one gloo process group): a real
  FSDP2 trainer (``examples/llama_fsdp.py``: the model in torch with the checkpoint's parameter
  names, ``fully_shard`` over gloo on CPU). Each hands its parameters' local shards
  (``DTensor.to_local()``: its dim-0 rows, bf16) to an ``mx.Publisher`` once (``set_shards``),
  and per step: waits until the previous version is handed back (``wait_staged``), takes one
  AdamW step of next-token cross entropy on its fixed batch (gradients averaged by FSDP2; the
  optimizer updates the shards in place), saves its shards to a reference file (from its own
  tensors) and publishes the version in place (``publish``: returns the version id once both
  slots published).
- engine-a and engine-b (two instances, each one process holding all three ranks of inference
  layout ``tp:3``): each allocates its parameters in the engine's own layout (vLLM names: fused
  ``qkv_proj``, ``gate_up_proj``), registers them with an ``mx.Puller`` (``retain=True``) and
  serves it to the control plane as a worker, which then drives stage and apply. On request it
  compares every parameter byte with the trainers' reference files.

Precision: the parameters and AdamW's state are bf16, the checkpoint's dtype (what mx publishes
is what the trainer holds); forward and backward run in fp32 (FSDP2's mixed precision policy).
The loss is the mean over both ranks' sequences; it falls step over step on the fixed batch.
"""

from __future__ import annotations

import argparse
import itertools
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

from procs import Child, ChildFailed, commands, free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER_LAYOUT = "fsdp:2"
ENGINE_LAYOUT = "tp:3"
# Two engine instances, each one process holding all three ranks of the tp:3 layout.
ENGINES = {"engine-a": [0, 1, 2], "engine-b": [0, 1, 2]}
LR = 1e-3  # AdamW on the bf16 parameters
BATCH = (1, 17)  # per trainer rank: one sequence of 17 token ids (16 next-token targets)

# safetensors dtype name -> (torch dtype name, bytes per element)
DTYPES = {
    "BF16": ("bfloat16", 2),
    "F16": ("float16", 2),
    "F32": ("float32", 4),
    "F64": ("float64", 8),
}


def _torch_dtype(name: str) -> Any:
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype {name} is not supported by this example")
    return getattr(torch, DTYPES[name][0])


def trainer_main(
    conn: Connection, url: str, model_dir: str, slot: int, tmpdir: str, init_method: str
) -> None:
    import llama_fsdp
    import torch

    import mx

    torch.set_num_threads(1)
    slots = int(TRAINER_LAYOUT.split(":")[1])
    model = mx.Model.from_dir(model_dir)
    net, opt = llama_fsdp.fsdp_trainer(model_dir, slot, slots, init_method, LR)
    # The FSDP2 shards: each parameter's local rows (DTensor.to_local()), updated in place by
    # AdamW, so they are registered once and published at every step.
    shards = llama_fsdp.local_shards(net, slots)
    names = sorted(t.name for t in model.tensors)
    if sorted(shards) != names:
        raise ValueError(f"the trainer's parameters differ from the model's: {sorted(shards)[:5]}")
    ptrs = {n: t.data_ptr() for n, (t, _) in shards.items()}
    # The fixed batch of this rank (data parallel: each rank has its own sequence).
    g = torch.Generator().manual_seed(20261202 + slot)
    batch = torch.randint(0, model.tensor("model.embed_tokens.weight").shape[0], BATCH, generator=g)

    pub = mx.Publisher(url, model=model, layout=TRAINER_LAYOUT, slot=slot)
    try:
        # Once: later publishes read the same memory again (in place).
        pub.set_shards({n: (t, offset) for n, (t, offset) in shards.items()})
        conn.send(("ready", {"slot": slot, "agent": pub.agent_name, "tensors": len(shards)}))
        for msg in commands(conn):
            _, label, prev, timeout = msg
            t0 = time.perf_counter()
            if prev is not None:
                # In place: the previous version's bytes are still being served until handed
                # back (every worker of its refit staged and verified it).
                why = pub.wait_staged(prev, timeout=timeout)
            else:
                why = None
            waited = time.perf_counter() - t0

            # One optimizer step (forward, backward, AdamW), in place on the bf16 shards.
            t0 = time.perf_counter()
            loss = llama_fsdp.train_step(net, opt, batch)
            step_s = time.perf_counter() - t0
            moved = [n for n, (t, _) in shards.items() if t.data_ptr() != ptrs[n]]
            assert not moved, f"parameters re-allocated by the step: {moved[:5]}"

            # The checker's reference: this version's shards, from the trainer's own tensors.
            ref = os.path.join(tmpdir, f"ref-{label}-slot{slot}.pt")
            torch.save({n: t.detach().clone() for n, (t, _) in shards.items()}, ref + ".tmp")
            os.replace(ref + ".tmp", ref)

            t0 = time.perf_counter()
            version_id = pub.publish(label, timeout=timeout)  # in place; READY when it returns
            publish_s = time.perf_counter() - t0
            conn.send(
                (
                    "published",
                    {
                        "label": label,
                        "version_id": version_id,
                        "loss": loss,
                        "addresses_unchanged": all(
                            t.data_ptr() == ptrs[n] for n, (t, _) in shards.items()
                        ),
                        "handed_back": why,
                        "wait_staged_s": waited,
                        "step_s": step_s,
                        "publish_s": publish_s,
                        "reference": ref,
                    },
                )
            )
    finally:
        pub.close()
    unchanged = all(t.data_ptr() == ptrs[n] for n, (t, _) in shards.items())
    conn.send(("bye", {"addresses_unchanged": unchanged}))


def _check(puller: Any, tensors: dict[int, dict[str, Any]], refs: list[str]) -> dict[str, Any]:
    """Compares every registered parameter's bytes with the trainers' reference files."""
    import torch

    shards = [torch.load(r, map_location="cpu", mmap=True, weights_only=True) for r in refs]
    full = {n: torch.cat([s[n] for s in shards], dim=0) for n in shards[0]}
    del shards
    mismatches = []
    pieces = 0
    checked = 0
    for info in puller.params():
        buf = tensors[info.rank][info.name].view(torch.uint8).reshape(-1)
        covered = []
        for pc in info.pieces:
            g = full[pc.tensor]
            if tuple(g.shape) != pc.global_shape:
                mismatches.append(f"rank {info.rank} {info.name}: {pc.tensor} shape {g.shape}")
                continue
            box = tuple(slice(o, o + e) for o, e in zip(pc.box_offset, pc.box_shape, strict=True))
            want = g[box].contiguous().view(torch.uint8).reshape(-1)
            got = buf[pc.offset : pc.offset + want.numel()]
            pieces += 1
            checked += want.numel()
            covered.append((pc.offset, pc.offset + want.numel()))
            if not torch.equal(got, want):
                bad = int((got != want).sum())
                mismatches.append(
                    f"rank {info.rank} {info.name} <- {pc.tensor}{list(pc.box_offset)}: "
                    f"{bad} of {want.numel()} bytes differ"
                )
        # Bytes in no piece (padding) must be zero.
        pos = 0
        for lo, hi in sorted(covered) + [(buf.numel(), buf.numel())]:
            if lo > pos and bool(buf[pos:lo].any()):
                mismatches.append(f"rank {info.rank} {info.name}: padding [{pos}, {lo}) not 0")
            pos = max(pos, hi)
    return {"ok": not mismatches, "mismatches": mismatches[:10], "pieces": pieces, "bytes": checked}


def engine_main(conn: Connection, url: str, model_dir: str, worker_id: str, ranks: list) -> None:
    import torch

    import mx

    torch.set_num_threads(1)
    model = mx.Model.from_dir(model_dir)
    puller = mx.Puller(
        url, model=model, layout=ENGINE_LAYOUT, ranks=ranks, worker_id=worker_id, retain=True
    )
    try:
        # The engine's own parameters, in its own layout; their addresses must never change.
        tensors: dict[int, dict[str, Any]] = {}
        ptrs = {}
        for rank in ranks:
            tensors[rank] = {
                p.name: torch.zeros(p.shape, dtype=_torch_dtype(p.dtype))
                for p in puller.params(rank)
            }
            ptrs[rank] = {n: t.data_ptr() for n, t in tensors[rank].items()}
            puller.register(rank, tensors[rank])
        engine_url = puller.serve(worker_id)  # from now on the control plane drives stage/apply
        conn.send(("ready", {"worker_id": worker_id, "url": engine_url, "ranks": ranks}))

        def addresses_unchanged() -> bool:
            return all(
                t.data_ptr() == ptrs[r][n] and puller.addresses(r)[n] == ptrs[r][n]
                for r in ranks
                for n, t in tensors[r].items()
            )

        for msg in commands(conn):
            if msg[0] == "check":
                _, label, refs = msg
                t0 = time.perf_counter()
                result = _check(puller, tensors, refs)
                mem = puller.memory_report()
                v = puller.versions
                # blake3 of every live parameter as mx computes it (listed in the report; the byte
                # comparison above, against tensors that never went through mx, is the check).
                digests = puller.live_digests()
                result.update(
                    label=label,
                    worker_id=worker_id,
                    check_s=time.perf_counter() - t0,
                    addresses_unchanged=addresses_unchanged(),
                    memory={
                        "rank_bytes": mem.rank_bytes,
                        "staging_bytes": mem.staging_bytes,
                        "staging_bytes_peak": mem.staging_bytes_peak,
                        "retained_bytes": mem.retained_bytes,
                    },
                    versions={"resident": v.resident, "retained": v.retained, "staged": v.staged},
                    live_digests=digests,
                )
                conn.send(("checked", result))
            else:
                raise ValueError(f"unknown command {msg!r}")
    finally:
        puller.close()
    conn.send(("bye", {}))


# --------------------------------------------------------------------------------------------
# The orchestrator (main process).


def run(args: argparse.Namespace, tmpdir: str) -> dict[str, Any]:
    import mx

    started = time.perf_counter()
    model_dir = args.model if os.path.isabs(args.model) else os.path.join(REPO, args.model)
    model = mx.Model.from_dir(model_dir)
    tensors = [(t.name, t.dtype, t.shape) for t in model.tensors]
    timeout = float(args.timeout)
    ctx = mp.get_context("spawn")
    children: list[Child] = []
    cp = mx.ControlPlane(journal=os.path.join(tmpdir, "journal.jsonl"))
    try:
        control = mx.Control(cp.url)
        print(f"control plane {cp.url}; model {model}", flush=True)
        engines = [
            Child(ctx, wid, engine_main, cp.url, model_dir, wid, ranks)
            for wid, ranks in ENGINES.items()
        ]
        gloo = f"tcp://127.0.0.1:{free_port()}"  # the trainers' process group
        trainers = [
            Child(ctx, f"trainer-{slot}", trainer_main, cp.url, model_dir, slot, tmpdir, gloo)
            for slot in range(int(TRAINER_LAYOUT.split(":")[1]))
        ]
        children += engines + trainers
        for c in children:
            info = c.recv("ready", timeout)
            print(f"{c.name} ready: {info}", flush=True)
        print(f"processes ready after {time.perf_counter() - started:.1f} s", flush=True)

        labels = [f"v{k}" for k in range(1, args.steps + 1)]
        versions = []
        trainer_addresses = True
        checks: dict[str, list[dict[str, Any]]] = {}

        def check(label: str) -> list[dict[str, Any]]:
            refs = [os.path.join(tmpdir, f"ref-{label}-slot{t}.pt") for t in range(len(trainers))]
            for e in engines:
                e.send("check", label, refs)
            return [e.recv("checked", timeout) for e in engines]

        for k, label in enumerate(labels):
            prev = labels[k - 1] if k else None
            control.declare(label, tensors, trainer_layout=TRAINER_LAYOUT)
            for t in trainers:
                t.send("step", label, prev, timeout)
            published = [t.recv("published", timeout) for t in trainers]
            ids = {p["version_id"] for p in published}
            if len(ids) != 1:
                raise RuntimeError(f"{label}: the trainers disagree on the version id: {ids}")
            version_id = ids.pop()
            trainer_addresses &= all(p["addresses_unchanged"] for p in published)
            losses = {p["loss"] for p in published}  # all-reduced: the same on every rank
            if len(losses) != 1:
                raise RuntimeError(f"{label}: the trainers disagree on the loss: {losses}")
            loss = losses.pop()

            r = control.refit(
                label,
                workers=list(ENGINES),
                stage_timeout=timeout,
                call_timeout=60.0,
                wait_timeout=timeout + 60.0,
            )
            if not r.committed:
                raise RuntimeError(f"refit to {label} ended {r.outcome}: {r.reason}")
            if r.target != version_id:
                raise RuntimeError(f"refit target {r.target} is not {label}'s id {version_id}")
            checks[label] = check(label)
            for c in checks[label]:
                if c["versions"]["resident"] != version_id:
                    c["ok"] = False
                    c["mismatches"].append(f"resident {c['versions']['resident']}")
            v = {
                "label": label,
                "version_id": version_id,
                "train_loss": loss,
                "stage_s": r.phase_seconds.get("STAGE"),
                "apply_s": r.phase_seconds.get("APPLY"),
                "refit_s": r.seconds,
                "outcome": str(r.outcome),
                "verified": all(c["ok"] for c in checks[label]),
                "stage_bytes": {w.worker_id: w.stage_bytes for w in r.workers.values()},
                "trainer": {
                    "handed_back": published[0]["handed_back"],
                    "wait_staged_s": max(p["wait_staged_s"] for p in published),
                    "step_s": max(p["step_s"] for p in published),
                    "publish_s": max(p["publish_s"] for p in published),
                },
            }
            versions.append(v)
            print(
                f"{label} {version_id[:19]}... loss {loss:.3e} refit {r.seconds:.2f} s "
                f"(stage {v['stage_s']} s, apply {v['apply_s']} s) verified={v['verified']}",
                flush=True,
            )

        # Rollback: the orchestrator refits the engines back to the previous version. They
        # hold it in their retained copy, so nothing is pulled (STAGE finds it retained) and
        # APPLY copies it back in place; the control plane's record follows.
        rollback_verified = False
        if len(labels) >= 2:
            target = versions[-2]
            r = control.refit(
                target["label"],
                workers=list(ENGINES),
                stage_timeout=timeout,
                call_timeout=60.0,
                wait_timeout=timeout + 60.0,
            )
            after = check(target["label"])
            checks[f"rollback-{target['label']}"] = after
            back = target["version_id"]
            rollback_verified = (
                r.committed
                and all(w.stage_bytes == 0 for w in r.workers.values())
                and all(c["ok"] and c["versions"]["resident"] == back for c in after)
            )
            print(
                f"rollback to {target['label']}: {r.outcome} in {r.seconds:.2f} s "
                f"(apply {r.phase_seconds.get('APPLY')} s, pulled "
                f"{sum(w.stage_bytes for w in r.workers.values())} bytes), "
                f"verified={rollback_verified}",
                flush=True,
            )

        last = {c["worker_id"]: c for c in list(checks.values())[-1]}
        engines_report = []
        staging_ok = True
        for wid in ENGINES:
            mem = last[wid]["memory"]
            rank_bytes = {int(r): b for r, b in mem["rank_bytes"].items()}
            engines_report.append(
                {
                    "worker_id": wid,
                    "ranks": [
                        {
                            "rank": r,
                            "rank_bytes": b,
                            # The puller reports staging and the retained copy per process: the
                            # retained copy holds each rank's bytes once (1x), staging is shared.
                            "rollback_bytes": b if mem["retained_bytes"] else 0,
                            "staging_bytes_peak_process": mem["staging_bytes_peak"],
                            "blake3": last[wid]["live_digests"][r],
                        }
                        for r, b in sorted(rank_bytes.items())
                    ],
                    "staging_bytes_peak": mem["staging_bytes_peak"],
                    "retained_bytes": mem["retained_bytes"],
                    "versions": last[wid]["versions"],
                }
            )
            staging_ok &= mem["staging_bytes_peak"] <= sum(rank_bytes.values())
            staging_ok &= mem["retained_bytes"] == sum(rank_bytes.values())

        for c in trainers + engines:
            c.send("exit")
            bye = c.recv("bye", timeout)
            if c in trainers:
                trainer_addresses &= bye["addresses_unchanged"]
        failed_checks = [
            f"{name}: {c['worker_id']}: {c['mismatches']}"
            for name, cs in checks.items()
            for c in cs
            if not c["ok"]
        ]
        losses = [v["train_loss"] for v in versions]
        return {
            "model": os.path.relpath(model_dir, REPO) if model_dir.startswith(REPO) else model_dir,
            "trainer_layout": TRAINER_LAYOUT,
            "engine_layout": ENGINE_LAYOUT,
            "versions": versions,
            "loss_fell": all(a > b for a, b in itertools.pairwise(losses)),
            "all_verified": all(v["verified"] for v in versions) and not failed_checks,
            "addresses_unchanged": trainer_addresses
            and all(c["addresses_unchanged"] for cs in checks.values() for c in cs),
            "rollback_verified": rollback_verified,
            "engines": engines_report,
            "staging_within_rank_bytes": staging_ok,
            "seconds": time.perf_counter() - started,
            "failed_checks": failed_checks,
        }
    finally:
        for c in children:
            c.stop()
        cp.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", required=True, help="where to write the JSON report")
    ap.add_argument("--model", default=".mx/models/smollm2-135m", help="HF checkpoint directory")
    ap.add_argument("--steps", type=int, default=3, help="versions to train and refit (>= 2)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds, for every wait")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be >= 2 (the rollback needs a previous version)")

    tmpdir = tempfile.mkdtemp(prefix="mx-python-refit-")
    try:
        report = run(args, tmpdir)
    except Exception as e:
        print(f"python_refit: FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        if not isinstance(e, ChildFailed):
            traceback.print_exc()
        return 1
    finally:
        if args.keep:
            print(f"kept {tmpdir}")
        else:
            shutil.rmtree(tmpdir, ignore_errors=True)

    checks = [
        "all_verified",
        "addresses_unchanged",
        "loss_fell",
        "rollback_verified",
        "staging_within_rank_bytes",
    ]
    failed = [k for k in checks if not report[k]]
    report["all_checks_hold"] = not failed and not report["failed_checks"]
    os.makedirs(os.path.dirname(os.path.abspath(args.report)), exist_ok=True)
    with open(args.report, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")

    print(f"\nreport: {args.report}")
    print(f"{'label':6} {'loss':>10} {'stage s':>8} {'apply s':>8} {'refit s':>8}  outcome")
    for v in report["versions"]:
        print(
            f"{v['label']:6} {v['train_loss']:10.3e} {v['stage_s'] or 0:8.3f} "
            f"{v['apply_s'] or 0:8.3f} {v['refit_s'] or 0:8.3f}  {v['outcome']}"
        )
    for k in checks:
        print(f"{k}: {report[k]}")
    print(f"seconds: {report['seconds']:.1f}")
    if not report["all_checks_hold"]:
        print(f"python_refit: FAILED: {', '.join(failed)}", file=sys.stderr)
        for line in report["failed_checks"]:
            print(f"  {line}", file=sys.stderr)
        return 1
    print("python_refit: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
