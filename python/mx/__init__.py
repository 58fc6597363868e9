"""mx: live policy-weight refit for RL, from Python.

Trainer ranks publish weight shards, inference workers pull exactly their byte ranges over NIXL,
and a control plane commits one policy version across the fleet (or aborts / rolls back).
This package is a thin layer over mx's Rust libraries (the extension module ``mx._mx``).

What exists now:

- :class:`ControlPlane`: the control plane, embedded in this process (its own threads, a durable
  journal, real gRPC on a local port).
- :class:`Control`: the orchestrator's client: :meth:`~Control.declare` a version,
  :meth:`~Control.refit` a worker set to it (a typed :class:`RefitResult`: outcome, per-worker
  calls, per-phase seconds), :meth:`~Control.wait_refit`, :meth:`~Control.status`.
- :func:`nixl_available`: whether NIXL (the data plane) loads in this process, from the
  ``nixl-cu12`` wheel this package depends on.
- :class:`MxError`: every failure mx reports (message: the whole Rust error chain; ``code``:
  the gRPC status name, when there is one).

- :class:`Model`: the model shards and parameters are checked against (from an HF
  checkpoint directory, or a config and tensor list).
- :class:`Publisher`: a trainer rank's side: publishes the shards it holds (:class:`Shard`:
  torch tensors, numpy arrays, DLPack objects, buffers) from their own memory, in place or
  as a snapshot; :meth:`~Publisher.wait_staged` says when they may be written again.
- :class:`Puller`: an inference rank's side: registers the engine's parameter tensors,
  stages a version (pull + verify), applies it in place (addresses never change), rolls back
  from a retained copy, or serves the control plane as a worker.

Importing ``mx`` sets ``MX_NIXL_DIR`` to the ``nixl-cu12`` wheel's library directory (unless the
environment sets it) and ``UCX_MODULES=^efa`` (unless set): see :mod:`mx._nixl`.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import _nixl

# Before the extension is loaded, so nothing can have loaded NIXL from elsewhere yet.
_nixl.configure()

from . import _mx, fp8  # noqa: E402
from ._control import Control, ControlPlane  # noqa: E402
from ._expected import expected_outputs  # noqa: E402
from ._model import Model  # noqa: E402
from ._publisher import Publisher, Shard  # noqa: E402
from ._puller import (  # noqa: E402
    ApplyReport,
    MemoryReport,
    ParamInfo,
    Piece,
    Puller,
    StagedPiece,
    StageReport,
    Versions,
)
from ._types import (  # noqa: E402
    Call,
    ExpectedOutputs,
    FleetStatus,
    GenerationCheck,
    Outcome,
    Probe,
    RefitResult,
    TensorSpec,
    VersionInfo,
    VersionState,
    VersionSummary,
    WorkerOutcome,
    WorkerStatus,
)

MxError = _mx.MxError
__version__: str = _mx.__version__


@dataclass(frozen=True)
class NixlStatus:
    """Whether NIXL loads in this process (truthy when it does), and from where."""

    available: bool
    #: The library loaded (``.../libnixl_capi.so``), when it loaded.
    loaded_from: str | None
    #: Why not (what was tried, the loader's errors), when it did not.
    reason: str | None
    #: The directory mx's loader was pointed at (``MX_NIXL_DIR``), or None.
    nixl_dir: str | None
    #: How that directory was chosen (the wheel and its version, or the environment).
    source: str

    def __bool__(self) -> bool:
        return self.available


def nixl_available(*, probe: bool = False) -> NixlStatus:
    """Loads NIXL's C API if it is not loaded yet and says whether that worked, and from where.

    Args:
        probe: also create (and drop) a NIXL agent with the UCX backend, which loads the UCX
            plugin and the bundled UCX libraries (about 0.1 s).

    Returns:
        A :class:`NixlStatus`, truthy when NIXL is usable. Never raises for a missing library.

    The library is looked up once per process: ``MX_NIXL_DIR`` (set at ``import mx`` from the
    installed ``nixl-cu12`` wheel unless the environment set it) is read at the first call.
    """
    ok, loaded_from, reason = _mx.nixl_status(probe)
    nixl_dir, source = _nixl._configured
    return NixlStatus(ok, loaded_from, reason, nixl_dir, source)


__all__ = [
    "ApplyReport",
    "Call",
    "Control",
    "ControlPlane",
    "ExpectedOutputs",
    "FleetStatus",
    "GenerationCheck",
    "MemoryReport",
    "Model",
    "MxError",
    "NixlStatus",
    "Outcome",
    "ParamInfo",
    "Piece",
    "Probe",
    "Publisher",
    "Puller",
    "RefitResult",
    "Shard",
    "StagedPiece",
    "StageReport",
    "TensorSpec",
    "VersionInfo",
    "VersionState",
    "VersionSummary",
    "Versions",
    "WorkerOutcome",
    "WorkerStatus",
    "fp8",
    "expected_outputs",
    "__version__",
    "nixl_available",
]
