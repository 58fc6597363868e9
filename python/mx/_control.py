"""The control plane inside a Python process, and the orchestrator's client."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from . import _mx
from ._types import (
    ExpectedOutputs,
    FleetStatus,
    GenerationCheck,
    RefitResult,
    TensorSpec,
    VersionInfo,
    VersionState,
)

MxError = _mx.MxError


def _mx_error(message: str, code: str | None) -> _mx.MxError:
    err = MxError(message)
    err.code = code
    return err


class ControlPlane:
    """The mx control plane (the Rust server of ``mx control``), running inside this Python
    process on its own tokio runtime (two threads named ``mx-control``) until :meth:`stop`.

    Args:
        journal: path of the durable journal (created if missing, with its directory;
            replayed if present, so a restarted control plane knows where the fleet is).
        listen: ``HOST:PORT`` to serve gRPC on; port 0 picks a free port (see :attr:`url`).
        tokens: token file, ``token,role,name[,scope]`` per line (as ``mx control --tokens``).
            Without it the control plane serves a loopback address only, unauthenticated (a
            warning is logged: every local process could refit the fleet).
        tls_cert, tls_key: PEM certificate chain and key: serve ``https://`` (both or neither;
            required with ``tokens`` on a non-loopback ``listen``).
        engine_token_file: bearer token sent on every engine call (vLLM's ``--api-key``).
        metrics: ``HOST:PORT`` to serve Prometheus ``/metrics``, ``/health`` and ``/ready`` on
            (see :attr:`metrics_url`).

    Raises:
        ValueError: a malformed ``listen`` or ``metrics``.
        MxError: the journal cannot be read or is corrupt, an address cannot be bound, a
            security file cannot be read or parsed, or the bind policy refuses the address.

    Use it as a context manager to stop it on exit::

        with mx.ControlPlane(journal="run/journal.jsonl") as cp:
            control = mx.Control(cp.url)

    Do not ``fork`` a process that runs one (its threads do not survive a fork); start
    workers with the ``spawn`` start method instead.
    """

    def __init__(
        self,
        journal: str | os.PathLike[str],
        listen: str = "127.0.0.1:0",
        *,
        tokens: str | os.PathLike[str] | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        engine_token_file: str | os.PathLike[str] | None = None,
        metrics: str | None = None,
    ) -> None:
        for name, value in (("listen", listen), ("metrics", metrics)):
            if value is not None and not isinstance(value, str):
                raise TypeError(
                    f"{name} must be a str such as '127.0.0.1:0', not {type(value).__name__}"
                )

        def path(p: str | os.PathLike[str] | None) -> str | None:
            return None if p is None else os.fspath(p)

        self._inner = _mx.ControlPlane(
            os.fspath(journal),
            listen,
            tokens=path(tokens),
            tls_cert=path(tls_cert),
            tls_key=path(tls_key),
            engine_token_file=path(engine_token_file),
            metrics=metrics,
        )

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` (``https://`` with TLS): what :class:`Control`, workers and
        publishers connect to."""
        return self._inner.url

    @property
    def metrics_url(self) -> str | None:
        """``http://HOST:PORT/metrics`` when started with ``metrics``, else ``None``."""
        return self._inner.metrics_url

    @property
    def address(self) -> str:
        """``HOST:PORT`` actually bound."""
        return self._inner.address

    @property
    def journal(self) -> str:
        """The journal file."""
        return os.fspath(self._inner.journal)

    @property
    def running(self) -> bool:
        """True until :meth:`stop`."""
        return self._inner.running

    def stop(self, timeout: float = 10.0) -> None:
        """Stops serving (open command streams and long polls end), closes the journal and the
        runtime. Idempotent.

        Args:
            timeout: seconds to wait for the server to stop (> 0).

        Raises:
            ValueError: a non-positive timeout.
            MxError: the server ended with an error, or did not stop in time.
        """
        self._inner.stop(timeout)

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ControlPlane(url={self.url!r}, journal={self.journal!r}, running={self.running})"


def _dtype_name(dtype: Any) -> str:
    """A dtype name mx parses, from a str, a torch dtype or a numpy dtype."""
    if isinstance(dtype, str):
        return dtype
    name = getattr(dtype, "name", None)  # numpy dtypes (and np.float32 & co. via np.dtype)
    if isinstance(name, str):
        return name
    text = str(dtype)  # torch.bfloat16
    return text.removeprefix("torch.")


def _tensor_specs(tensors: Any) -> list[tuple[str, str, list[int]]]:
    """``(name, dtype, shape)`` triples from the forms :meth:`Control.declare` accepts."""
    if isinstance(tensors, (str, bytes)):
        raise TypeError("tensors must be a mapping or a sequence of tensor descriptions, not a str")
    if isinstance(tensors, Mapping):
        items: Iterable[Any] = (
            (name, *v) if isinstance(v, tuple) else (name, v) for name, v in tensors.items()
        )
    elif isinstance(tensors, Iterable):
        items = tensors
    else:
        raise TypeError(
            f"tensors must be a mapping or a sequence of tensor descriptions, "
            f"not {type(tensors).__name__}"
        )
    out = []
    for i, t in enumerate(items):
        if isinstance(t, TensorSpec):
            name, dtype, shape = t.name, t.dtype, t.shape
        elif isinstance(t, tuple) and len(t) == 2:  # (name, tensor)
            name, tensor = t
            dtype, shape = getattr(tensor, "dtype", None), getattr(tensor, "shape", None)
            if dtype is None or shape is None:
                raise TypeError(
                    f"tensors[{i}] ({name!r}): expected a tensor or array (with .dtype and "
                    f".shape) or (dtype, shape), got {type(tensor).__name__}"
                )
        elif isinstance(t, tuple) and len(t) == 3:
            name, dtype, shape = t
        else:
            raise TypeError(f"tensors[{i}]: expected TensorSpec or (name, dtype, shape), got {t!r}")
        if not isinstance(name, str) or not name:
            raise TypeError(f"tensors[{i}]: the name must be a non-empty str, got {name!r}")
        try:
            dims = [int(d) for d in shape]
        except TypeError:
            raise TypeError(
                f"tensor {name!r}: shape must be a sequence of ints, got {shape!r}"
            ) from None
        if any(d < 0 for d in dims):
            raise ValueError(f"tensor {name!r}: shape has a negative dimension: {dims}")
        out.append((name, _dtype_name(dtype), dims))
    return out


def _workers(workers: Any) -> list[str]:
    if isinstance(workers, str):
        raise TypeError("workers must be a sequence of worker ids, not one str")
    if not isinstance(workers, Iterable):
        raise TypeError(f"workers must be a sequence of worker ids, not {type(workers).__name__}")
    ids = list(workers)
    for w in ids:
        if not isinstance(w, str):
            raise TypeError(f"workers: each worker id must be a str, got {w!r}")
    return ids


class Control:
    """The orchestrator's client of a control plane: declare versions, refit worker sets,
    read the fleet's state. Every method blocks with the GIL released, under a deadline.

    Args:
        url: ``http://HOST:PORT`` (or ``HOST:PORT``) of the control plane.
        timeout: seconds to connect, and the default deadline of each call (> 0).
        token: the control-plane token this client presents, in place of the process's
            ``MX_CONTROL_TOKEN`` / ``MX_CONTROL_TOKEN_FILE`` (a process whose clients hold
            different roles, e.g. a trainer rank's publisher and orchestrator). At most one
            of ``token`` and ``token_file``.
        token_file: a file holding that token (as ``MX_CONTROL_TOKEN_FILE``).

    Raises:
        ValueError: a non-positive timeout or an empty url.
        MxError: nothing answered at ``url`` (``code`` ``"Unavailable"`` or
            ``"DeadlineExceeded"``).

    Every method raises ``MxError`` when the control plane refuses or fails the call (its
    message is the control plane's, naming the version, worker or field at fault; ``code`` is
    the gRPC status name) and ``TypeError``/``ValueError`` for bad arguments found before the
    call is made.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 30.0,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(url, str):
            raise TypeError(f"url must be a str, not {type(url).__name__}")
        self._inner = _mx.ControlClient(
            url,
            float(timeout),
            token=token,
            token_file=None if token_file is None else os.fspath(token_file),
        )

    @property
    def url(self) -> str:
        """The control plane's URL."""
        return self._inner.url

    @property
    def timeout(self) -> float:
        """The default deadline of each call, seconds."""
        return self._inner.timeout

    def declare(
        self,
        label: str,
        tensors: Any,
        *,
        trainer_layout: str,
        timeout: float | None = None,
    ) -> None:
        """Declares policy version ``label``: its tensors and the trainer layout whose source
        slots (``0..N``) will publish it. Idempotent when declared identically.

        Args:
            label: human label (e.g. the trainer step); not the version's identity.
            tensors: the tensors' global names, dtypes and shapes, as a mapping
                ``name -> tensor`` (anything with ``.dtype`` and ``.shape``: torch tensors,
                numpy arrays) or ``name -> (dtype, shape)``, or a sequence of
                :class:`TensorSpec` or ``(name, dtype, shape)``. Dtypes are safetensors names
                (``"BF16"``, ``"F32"``), torch dtypes or numpy dtypes.
            trainer_layout: ``"fsdp:N"``, ``"tp:N"``, ``"replicated:N"`` or
                ``"megatron:tp=T,pp=P,ep=E"`` (Megatron-Core's ranks and names).
            timeout: deadline in seconds (default: the client's).

        Raises:
            MxError: ``AlreadyExists`` when declared differently, ``InvalidArgument`` for a bad
                layout, dtype or tensor list.
        """
        self._inner.declare(label, _tensor_specs(tensors), trainer_layout, timeout)

    def version(self, label: str, *, timeout: float | None = None) -> VersionInfo:
        """Everything known about version ``label``.

        Raises:
            MxError: ``NotFound`` for an undeclared label.
        """
        return VersionInfo._from_json(json.loads(self._inner.get_version(label, timeout)))

    def wait_version(
        self, label: str, state: VersionState | str = VersionState.READY, *, timeout: float = 60.0
    ) -> VersionInfo:
        """Waits until version ``label`` reaches ``state`` or a later one (an undeclared label
        is waited for too). Ctrl-C interrupts the wait.

        Args:
            timeout: seconds to wait (> 0).

        Raises:
            MxError: ``DeadlineExceeded`` when ``timeout`` passed first.
        """
        return VersionInfo._from_json(
            json.loads(self._inner.wait_version(label, str(state), timeout))
        )

    def status(self, *, digests: bool = False, timeout: float | None = None) -> FleetStatus:
        """Every version (with its sources and whether its publishers are alive) and every
        registered worker (its state, resident version, whether rollouts may be sent to it and,
        when not, why: :attr:`WorkerStatus.gate`). ``digests``: include each worker's
        per-tensor digests of its last stage (thousands per worker)."""
        return FleetStatus._from_json(json.loads(self._inner.status(timeout, digests)))

    def accept_journal(self, reason: str, *, timeout: float | None = None) -> dict[str, Any]:
        """Accepts the journal as it stands after the fleet contradicted it
        (:attr:`FleetStatus.halted`: a worker holds a version, or was called by a refit, that
        the journal lost). Journaled with ``reason``; the control plane acts on the fleet
        again. Returns ``{"accepted": [str], "resumed_refit": int | None}``: the
        contradictions accepted, and the open refit that is then settled as after a restart.

        Raises:
            MxError: ``FailedPrecondition`` when nothing contradicts the journal,
                ``InvalidArgument`` for an empty or unprintable reason, ``PermissionDenied``
                outside the orchestrator role.
        """
        return json.loads(self._inner.accept_journal(reason, timeout))

    def publish_expected_outputs(
        self, label: str, outputs: ExpectedOutputs, *, timeout: float | None = None
    ) -> None:
        """Publishes the outputs version ``label``'s trainer expects of it (computed with its
        own forward pass on the published weights, e.g. by :func:`mx.expected_outputs`): every
        refit of the version then checks each engine against them, unless it brings a check of
        its own or sets ``no_check``. Journaled; publishing the same outputs again is a no-op.
        Needs the publisher or orchestrator role.

        Raises:
            MxError: ``NotFound`` for an undeclared label, ``InvalidArgument`` naming the field
                at fault (``outputs.probes[1].margins``), ``FailedPrecondition`` when other
                outputs were already published for the version.
            ValueError: outputs out of bounds (1-16 probes, 1-1024 new tokens, prompts of
                1-4096 tokens, one margin and log-probability per token).
        """
        if not isinstance(outputs, ExpectedOutputs):
            raise TypeError(f"outputs must be ExpectedOutputs, not {type(outputs).__name__}")
        self._inner.publish_expected_outputs(label, outputs._wire(), timeout)

    def retire_worker(
        self, worker_id: str, reason: str = "", *, timeout: float | None = None
    ) -> None:
        """Retires a departed worker id (journaled): :meth:`status`, admission and default
        worker sets forget it. A worker's own process retires its id when its puller closes.

        Raises:
            MxError: ``NotFound`` for an unknown id, ``AlreadyExists`` while its command stream
                is connected, ``FailedPrecondition`` while a refit holds it,
                ``PermissionDenied`` outside the caller's role.
        """
        self._inner.retire_worker(worker_id, reason, timeout)

    def start_refit(
        self,
        label: str,
        workers: Sequence[str],
        *,
        pause_mode: str = "wait",
        allow_partial: bool = False,
        check: GenerationCheck | ExpectedOutputs | None = None,
        no_check: bool = False,
        framework_step: int = 0,
        stage_timeout: float = 300.0,
        call_timeout: float = 60.0,
        apply_parallelism: int = 0,
        orchestrator_gated: bool = False,
        verify_from_apply_answer: bool = False,
        timeout: float | None = None,
    ) -> int:
        """Starts a refit of ``workers`` to version ``label`` and returns its id at once; see
        :meth:`refit` for the arguments and :meth:`wait_refit` to follow it."""
        chk = None
        if check is not None:
            if not isinstance(check, (GenerationCheck, ExpectedOutputs)):
                raise TypeError(
                    "check must be a GenerationCheck, ExpectedOutputs or None, not "
                    f"{type(check).__name__}"
                )
            chk = check._wire()
        return self._inner.start_refit(
            label,
            _workers(workers),
            pause_mode=pause_mode,
            allow_partial=allow_partial,
            check=chk,
            no_check=no_check,
            framework_step=framework_step,
            stage_timeout=stage_timeout,
            call_timeout=call_timeout,
            apply_parallelism=apply_parallelism,
            orchestrator_gated=orchestrator_gated,
            verify_from_apply_answer=verify_from_apply_answer,
            timeout=timeout,
        )

    def refit(
        self,
        label: str,
        workers: Sequence[str],
        *,
        pause_mode: str = "wait",
        allow_partial: bool = False,
        check: GenerationCheck | ExpectedOutputs | None = None,
        no_check: bool = False,
        framework_step: int = 0,
        stage_timeout: float = 300.0,
        call_timeout: float = 60.0,
        apply_parallelism: int = 0,
        orchestrator_gated: bool = False,
        verify_from_apply_answer: bool = False,
        timeout: float | None = None,
        wait_timeout: float | None = None,
    ) -> RefitResult:
        """Moves the worker set to version ``label`` (READY, or committed before) and waits for
        the end: STAGE, PREPARE, APPLY, VERIFY, RESUME, CHECK, COMMIT, or ABORT / ROLLBACK.
        The control plane drives and journals every step; this call only starts and follows.

        Args:
            label: the version.
            workers: target worker ids (registered, with engine routes).
            pause_mode: in-flight requests at PREPARE: ``"keep"``, ``"wait"``, ``"abort"``,
                ``"retract"`` or ``"in_place"`` (SGLang's; ``"keep"`` and ``"wait"`` are
                SGLang's retract: it has no wait).
            allow_partial: proceed without workers that are not connected.
            check: a post-update check of your own; None (the default): the expected outputs
                published with the version (:meth:`publish_expected_outputs`), if any.
            no_check: no post-update generation at all, even with published outputs.
            framework_step: the trainer's step, journaled with the refit.
            stage_timeout: deadline of the whole STAGE phase, seconds.
            call_timeout: deadline of each engine call, seconds.
            apply_parallelism: workers applying at once (0: all).
            orchestrator_gated: the caller holds the safe point itself (no pause/resume calls).
            verify_from_apply_answer: take the resident version from the apply answer where
                the engine reports one, instead of a separate read-back.
            timeout: deadline of the start call, seconds (default: the client's).
            wait_timeout: seconds to wait for the end (default: ``stage_timeout`` + 8 x
                ``call_timeout`` + 60, past every deadline the control plane itself applies).

        Returns:
            The ended refit; check :attr:`RefitResult.committed` (an ABORTED or ROLLED_BACK
            refit is an answer, not an exception).

        Raises:
            MxError: the control plane refused to start it (``InvalidArgument``: an empty or
                duplicate worker set, a bad check; ``NotFound``: unknown label;
                ``FailedPrecondition``: version not READY, unknown worker, a refit open), or it
                did not end within ``wait_timeout`` (``DeadlineExceeded``; it goes on:
                :meth:`wait_refit`).
        """
        refit_id = self.start_refit(
            label,
            workers,
            pause_mode=pause_mode,
            allow_partial=allow_partial,
            check=check,
            no_check=no_check,
            framework_step=framework_step,
            stage_timeout=stage_timeout,
            call_timeout=call_timeout,
            apply_parallelism=apply_parallelism,
            orchestrator_gated=orchestrator_gated,
            verify_from_apply_answer=verify_from_apply_answer,
            timeout=timeout,
        )
        if wait_timeout is None:
            wait_timeout = float(stage_timeout) + 8 * float(call_timeout) + 60.0
        r = self.wait_refit(refit_id, timeout=wait_timeout)
        if not r.ended:
            raise _mx_error(
                f"refit {refit_id} of {label!r} did not end within {wait_timeout} s (now in "
                f"{r.phase}); it goes on: follow it with wait_refit({refit_id})",
                "DeadlineExceeded",
            )
        return r

    def wait_refit(self, refit_id: int = 0, *, timeout: float = 60.0) -> RefitResult:
        """Waits up to ``timeout`` seconds for refit ``refit_id`` (0: the latest) to end and
        returns its record, ended or not (see :attr:`RefitResult.ended`). Ctrl-C interrupts it.

        Raises:
            ValueError: a negative id or a non-positive timeout.
            MxError: ``NotFound`` when there is no such refit.
        """
        if isinstance(refit_id, bool) or not isinstance(refit_id, int):
            raise TypeError(f"refit_id must be an int, not {type(refit_id).__name__}")
        if refit_id < 0:
            raise ValueError(f"refit_id must be >= 0, got {refit_id}")
        text = self._inner.wait_refit(refit_id, timeout)
        if text is None:
            raise _mx_error(
                f"refit {refit_id} is unknown to the control plane at {self.url}"
                if refit_id
                else f"no refit was started on the control plane at {self.url}",
                "NotFound",
            )
        return RefitResult._from_json(json.loads(text))

    def __repr__(self) -> str:
        return f"Control(url={self.url!r})"
