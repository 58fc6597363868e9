"""Type stubs of the extension module mx._mx (the Rust side of the package; use ``mx``)."""

import os

__version__: str

class MxError(Exception):
    """An error reported by mx; ``code`` is the gRPC status name, or None."""

    code: str | None

def nixl_status(probe: bool = False) -> tuple[bool, str | None, str | None]: ...

class ControlPlane:
    def __init__(self, journal: str | os.PathLike[str], listen: str = "127.0.0.1:0") -> None: ...
    @property
    def url(self) -> str: ...
    @property
    def address(self) -> str: ...
    @property
    def journal(self) -> str: ...
    @property
    def running(self) -> bool: ...
    def stop(self, timeout: float = 10.0) -> None: ...
    def __enter__(self) -> ControlPlane: ...
    def __exit__(self, *args: object) -> bool: ...

class ControlClient:
    def __init__(self, url: str, timeout: float = 30.0) -> None: ...
    @property
    def url(self) -> str: ...
    @property
    def timeout(self) -> float: ...
    def declare(
        self,
        label: str,
        tensors: list[tuple[str, str, list[int]]],
        trainer_layout: str,
        timeout: float | None = None,
    ) -> None: ...
    def get_version(self, label: str, timeout: float | None = None) -> str: ...
    def wait_version(self, label: str, state: str, timeout: float) -> str: ...
    def status(self, timeout: float | None = None) -> str: ...
    def start_refit(
        self,
        label: str,
        workers: list[str],
        *,
        pause_mode: str = "wait",
        allow_partial: bool = False,
        check: tuple[list[int], int, list[int]] | None = None,
        framework_step: int = 0,
        stage_timeout: float = 300.0,
        call_timeout: float = 60.0,
        apply_parallelism: int = 0,
        orchestrator_gated: bool = False,
        verify_from_apply_answer: bool = False,
        timeout: float | None = None,
    ) -> int: ...
    def wait_refit(self, refit_id: int, timeout: float) -> str | None: ...
