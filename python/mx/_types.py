"""The typed answers of the control plane: versions, workers, refits.

Built from the JSON the extension returns; every object keeps the decoded record as ``raw``
for fields not surfaced here. Times are seconds (floats), sizes bytes, timestamps Unix seconds.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class VersionState(str, enum.Enum):
    """Lifecycle of a policy version:
    DECLARED -> PUBLISHING -> READY -> COMMITTING -> COMMITTED."""

    DECLARED = "DECLARED"
    PUBLISHING = "PUBLISHING"
    READY = "READY"
    COMMITTING = "COMMITTING"
    COMMITTED = "COMMITTED"

    def __str__(self) -> str:
        return self.value


class Outcome(str, enum.Enum):
    """How a refit ended."""

    #: Every worker of the set runs the version; rollouts admitted.
    COMMITTED = "COMMITTED"
    #: Failed before any apply: every worker kept its version.
    ABORTED = "ABORTED"
    #: Failed after some applies: every worker is back on its previous version.
    ROLLED_BACK = "ROLLED_BACK"
    #: A worker could not be brought back in time; it stays gated until refitted again.
    FENCED = "FENCED"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a version as declared: global name, dtype (safetensors spelling such as
    ``"BF16"``, or a torch/numpy name such as ``"bfloat16"``/``"float32"``), global shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class GenerationCheck:
    """A post-update check of your own: greedy decoding of ``prompt_tokens`` for
    ``max_new_tokens`` (>= 1) tokens on every worker after applying. With ``expected_tokens``
    (golden tokens computed outside mx) the output must equal them exactly; without, it must
    only succeed. Prefer :class:`ExpectedOutputs` published with the version."""

    prompt_tokens: tuple[int, ...]
    max_new_tokens: int
    expected_tokens: tuple[int, ...] = ()

    def _wire(self) -> tuple:
        probe = (list(self.prompt_tokens), list(self.expected_tokens), [], [])
        return ([probe], int(self.max_new_tokens), 0.0, "")


@dataclass(frozen=True)
class Probe:
    """One probe of a version's expected outputs: a prompt (token ids) and the greedy tokens
    the trainer's own forward pass produced after it, with, per generated position, the margin
    ``log p(top1) - log p(top2)`` (nats) and the log-probability of the chosen token."""

    prompt_tokens: tuple[int, ...]
    tokens: tuple[int, ...]
    margins: tuple[float, ...] = ()
    logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class ExpectedOutputs:
    """The outputs a version's trainer expects of it (see :func:`mx.expected_outputs` to
    compute them and :meth:`Control.publish_expected_outputs` to publish them). Every engine's
    greedy tokens must equal each probe's exactly up to a first near-tie: the first position
    where they differ is accepted only where the trainer's margin there is below
    ``tie_margin`` nats (0: mx's default, 0.25, when margins are given), and later tokens are
    then not compared."""

    probes: tuple[Probe, ...]
    max_new_tokens: int
    tie_margin: float = 0.0

    @classmethod
    def _from_json(cls, d: Mapping[str, Any]) -> ExpectedOutputs:
        return cls(
            probes=tuple(
                Probe(
                    tuple(p["prompt_tokens"]),
                    tuple(p.get("tokens", ())),
                    tuple(p.get("margins", ())),
                    tuple(p.get("logprobs", ())),
                )
                for p in d["probes"]
            ),
            max_new_tokens=d["max_new_tokens"],
            tie_margin=d.get("tie_margin", 0.0),
        )

    def _wire(self) -> tuple:
        probes = [
            (list(p.prompt_tokens), list(p.tokens), list(p.margins), list(p.logprobs))
            for p in self.probes
        ]
        return (probes, int(self.max_new_tokens), float(self.tie_margin), "")


@dataclass(frozen=True)
class VersionSummary:
    """One version in :class:`FleetStatus`."""

    label: str
    state: VersionState
    #: 64 hex digits (the version's identity) once READY, else None.
    version_digest: str | None
    #: Slots of its trainer layout.
    slots: int = 0
    #: One per published slot: ``{"slot", "agent_name", "retired_by", "last_seen_ms",
    #: "liveness"}``, liveness ``"live"`` (heard within 3 s), ``"silent"`` or ``"unknown"``.
    publishers: tuple[Mapping[str, Any], ...] = ()
    #: Workers serving it from their memory.
    peers: tuple[str, ...] = ()
    #: URIs of its artifacts in object storage.
    artifacts: tuple[str, ...] = ()
    #: Why its sources may stop serving it, once they may (else None).
    release: str | None = None


@dataclass(frozen=True)
class WorkerStatus:
    """One registered worker in :class:`FleetStatus`."""

    worker_id: str
    instance: str
    ranks: tuple[int, ...]
    #: Its inference layout, e.g. ``"tp:3"``.
    layout: str
    #: Stage state for ``label``: IDLE, STAGING, STAGED or FAILED.
    state: str
    label: str | None
    version_digest: str | None
    #: Version id resident in its live weights (``mx:<hex>`` for mx versions).
    resident_id: str | None
    last_error: str | None
    #: Rollouts may be sent to it.
    admitted: bool
    #: Why it is not admitted ("" when admitted).
    admission: str
    #: It has a command stream open to the control plane now.
    connected: bool
    #: ``{"api": "vllm"|"dynamo"|"dynamo_sglang"|"sglang", "system_url": ...}`` or None.
    engine: Mapping[str, Any] | None
    #: Its last stage report (bytes, seconds, source...; per-tensor digests only with
    #: ``status(digests=True)``) or None.
    last_staged: Mapping[str, Any] | None
    #: Why it is not admitted, by kind: ``in_refit``, ``departed``, ``engine_unread``,
    #: ``fenced``, ``no_weights``, ``stale``, ``disconnected`` (None when admitted).
    gate: str | None = None
    #: The label of the declared version resident in it, if any has that id.
    resident_label: str | None = None


@dataclass(frozen=True)
class FleetStatus:
    """Every version (in declaration order) and every registered worker (by id)."""

    versions: tuple[VersionSummary, ...]
    workers: tuple[WorkerStatus, ...]
    #: The version the fleet last committed, as ``(label, version_id)``.
    fleet_version: tuple[str, str] | None
    #: Id of the refit in progress, if any.
    open_refit: int | None
    #: Set while the control plane does not act on its fleet: the fleet contradicted its
    #: journal (what, and what to do: :meth:`Control.accept_journal` or a restored journal).
    halted: str | None = None
    raw: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)

    def version(self, label: str) -> VersionSummary | None:
        """The version with this label, or None."""
        return next((v for v in self.versions if v.label == label), None)

    def worker(self, worker_id: str) -> WorkerStatus | None:
        """The worker with this id, or None."""
        return next((w for w in self.workers if w.worker_id == worker_id), None)

    @property
    def admitted(self) -> tuple[str, ...]:
        """Ids of the workers rollouts may be sent to."""
        return tuple(w.worker_id for w in self.workers if w.admitted)

    @classmethod
    def _from_json(cls, d: Mapping[str, Any]) -> FleetStatus:
        fv = d.get("fleet_version")
        return cls(
            versions=tuple(
                VersionSummary(
                    v["label"],
                    VersionState(v["state"]),
                    v["version_digest"],
                    slots=v["slots"],
                    publishers=tuple(v["publishers"]),
                    peers=tuple(v["peers"]),
                    artifacts=tuple(v["artifacts"]),
                    release=v["release"],
                )
                for v in d["versions"]
            ),
            workers=tuple(
                WorkerStatus(
                    worker_id=w["worker_id"],
                    instance=w["instance"],
                    ranks=tuple(w["ranks"]),
                    layout=w["layout"],
                    state=w["state"],
                    label=w["label"],
                    version_digest=w["version_digest"],
                    resident_id=w["resident_id"],
                    last_error=w["last_error"],
                    admitted=w["admitted"],
                    admission=w["admission"],
                    connected=w["connected"],
                    engine=w["engine"],
                    last_staged=w["last_staged"],
                    gate=w["gate"],
                    resident_label=w["resident_label"],
                )
                for w in d["workers"]
            ),
            fleet_version=(fv["label"], fv["version_id"]) if fv else None,
            open_refit=d.get("open_refit"),
            halted=d.get("halted"),
            raw=d,
        )


@dataclass(frozen=True)
class VersionInfo:
    """Everything known about one version (manifests counted, not listed)."""

    label: str
    state: VersionState
    #: Layout of the sources, e.g. ``"fsdp:2"`` (source slots ``0..N``).
    trainer_layout: str
    tensors: tuple[TensorSpec, ...]
    #: 64 hex digits once READY, else None.
    version_digest: str | None
    published_slots: tuple[int, ...]
    missing_slots: tuple[int, ...]
    missing_tensors: tuple[str, ...]
    #: Number of published manifests.
    manifests: int
    #: The worker set of the refit committing it, once committing.
    commit_workers: tuple[str, ...]
    #: The outputs its trainer published for the post-update check
    #: (:meth:`Control.publish_expected_outputs`), or None.
    expected_outputs: ExpectedOutputs | None = None
    raw: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @property
    def version_id(self) -> str | None:
        """``mx:<hex>``, the id engines report for this version, once READY."""
        return f"mx:{self.version_digest}" if self.version_digest else None

    @classmethod
    def _from_json(cls, d: Mapping[str, Any]) -> VersionInfo:
        return cls(
            label=d["label"],
            state=VersionState(d["state"]),
            trainer_layout=d["trainer_layout"],
            tensors=tuple(
                TensorSpec(t["name"], t["dtype"], tuple(t["shape"])) for t in d["tensors"]
            ),
            version_digest=d["version_digest"],
            published_slots=tuple(d["published_slots"]),
            missing_slots=tuple(d["missing_slots"]),
            missing_tensors=tuple(d["missing_tensors"]),
            manifests=d["manifests"],
            commit_workers=tuple(d["commit_workers"]),
            expected_outputs=ExpectedOutputs._from_json(d["expected_outputs"])
            if d.get("expected_outputs")
            else None,
            raw=d,
        )


@dataclass(frozen=True)
class Call:
    """One engine call a refit made to one worker."""

    #: ``pause``, ``apply``, ``read_version``, ``resume`` or ``generate``.
    action: str
    #: The phase it belongs to (``STAGE`` ... ``ROLLBACK``).
    phase: str
    #: True/False once it finished; None while in flight (or lost in a control-plane crash).
    ok: bool | None
    error: str
    seconds: float
    #: The version the engine reported resident (apply, read_version), if any.
    version: str | None
    #: Generated tokens (generate).
    tokens: tuple[int, ...]
    message: str
    #: The requests an apply made, in order -> their wall seconds (vLLM: ``start_weight_update``,
    #: ``update_weights``, ``finish_weight_update``, ``reset_prefix_cache``); empty where the
    #: engine client does not time them.
    steps: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerOutcome:
    """What a refit did to one worker of its set."""

    worker_id: str
    #: Resident version id when the refit began (the rollback target).
    previous: str | None
    #: Resident version id now, as last learned.
    resident: str | None
    #: ``resident`` is the refit's target version.
    on_target: bool
    #: An apply was issued to it (its weights may have changed).
    applied: bool
    #: STAGE seconds as the worker reported them, and useful bytes pulled.
    stage_seconds: float
    stage_bytes: int
    calls: tuple[Call, ...]
    #: The first failed call's error, or None.
    error: str | None
    #: It registered again during the refit (restart or reconnect).
    rejoined: bool


@dataclass(frozen=True)
class RefitResult:
    """A refit as the control plane recorded it: how it ended (or that it has not yet), each
    worker's outcome and calls, and how long each phase took."""

    refit_id: int
    label: str
    #: ``mx:<hex>``, the version id the refit moves the set to.
    target: str
    #: The target's 64-hex digest.
    version_digest: str
    #: False while the refit is still open (then ``outcome`` is None).
    ended: bool
    outcome: Outcome | None
    #: Why it did not commit ("" when it did or is open).
    reason: str
    #: Current (or last) phase.
    phase: str
    #: Phase name -> seconds spent in it, in order (the open phase counts up to now: absent).
    phase_seconds: Mapping[str, float]
    workers: Mapping[str, WorkerOutcome]
    #: Workers left out (not connected) -> why, when ``allow_partial``.
    dropped: Mapping[str, str]
    #: Unix seconds of BEGIN and END (None while open); ``seconds`` is END - BEGIN.
    started: float
    ended_at: float | None
    seconds: float | None
    #: A control plane recovered this refit after a restart.
    recovered: bool
    raw: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @property
    def committed(self) -> bool:
        """True when the refit ended COMMITTED."""
        return self.outcome is Outcome.COMMITTED

    @classmethod
    def _from_json(cls, d: Mapping[str, Any]) -> RefitResult:
        phases = [(str(p).upper(), int(ms)) for p, ms in d["phases"]]
        ended_ms = d.get("ended_ms")
        phase_seconds: dict[str, float] = {}
        for i, (name, start) in enumerate(phases):
            end = phases[i + 1][1] if i + 1 < len(phases) else ended_ms
            if end is not None:
                phase_seconds[name] = phase_seconds.get(name, 0.0) + max(0, end - start) / 1000
        workers = {}
        for wid, w in d["workers"].items():
            calls = []
            for c in w["calls"]:
                action = c["action"]
                r = c.get("result")
                calls.append(
                    Call(
                        action=action["call"],
                        phase=str(c["phase"]).upper(),
                        ok=None if r is None else bool(r["ok"]),
                        error="" if r is None else r["error"],
                        seconds=0.0 if r is None else float(r["seconds"]),
                        version=None if r is None else r.get("version"),
                        tokens=() if r is None else tuple(r.get("tokens", ())),
                        message="" if r is None else r.get("message", ""),
                        steps={}
                        if r is None
                        else {s["step"]: float(s["seconds"]) for s in r.get("steps", ())},
                    )
                )
            failed = next((c for c in calls if c.ok is False), None)
            workers[wid] = WorkerOutcome(
                worker_id=wid,
                previous=w["previous"],
                resident=w["resident"],
                on_target=w["resident"] == d["target"],
                applied=any(c.action == "apply" for c in calls),
                stage_seconds=float(w["stage_seconds"]),
                stage_bytes=int(w["stage_bytes"]),
                calls=tuple(calls),
                error=failed.error if failed else None,
                rejoined=w.get("reregistered") is not None,
            )
        outcome = d.get("outcome")
        started_ms = int(d["started_ms"])
        return cls(
            refit_id=int(d["id"]),
            label=d["spec"]["label"],
            target=d["target"],
            version_digest=d["digest"],
            ended=bool(d.get("ended", outcome is not None)),
            outcome=Outcome(str(outcome).upper()) if outcome else None,
            reason=d["reason"],
            phase=str(d["phase"]).upper(),
            phase_seconds=phase_seconds,
            workers=workers,
            dropped={w: why for w, why in d["dropped"]},
            started=started_ms / 1000,
            ended_at=None if ended_ms is None else ended_ms / 1000,
            seconds=None if ended_ms is None else max(0, ended_ms - started_ms) / 1000,
            recovered=bool(d["recovered"]),
            raw=d,
        )
