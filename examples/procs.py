"""Child processes for the examples: each runs a target function that talks to the main
process over a ``multiprocessing`` Pipe (``spawn`` start method), and reports any failure as
``("error", traceback)`` instead of dying silently."""

from __future__ import annotations

import socket
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection, wait
from typing import Any


class ChildFailed(RuntimeError):
    """A child process reported an error (its traceback is the message) or died."""


def child_main(target: Any, conn: Connection, *args: Any) -> None:
    try:
        target(conn, *args)
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
        raise SystemExit(1) from None
    finally:
        conn.close()


def commands(conn: Connection) -> Any:
    """Main's commands, until ``("exit",)``; a child left without one for 600 s gives up."""
    while True:
        if not conn.poll(600):
            raise TimeoutError("no command from main in 600 s")
        msg = conn.recv()
        if msg[0] == "exit":
            return
        yield msg


class Child:
    """A child process running ``target(conn, *args)`` under :func:`child_main`."""

    def __init__(self, ctx: Any, name: str, target: Any, *args: Any) -> None:
        self.name = name
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(
            target=child_main, args=(target, child_conn, *args), name=name, daemon=True
        )
        self.proc.start()
        child_conn.close()

    def send(self, *msg: Any) -> None:
        self.conn.send(msg)

    def recv(self, expect: str, timeout: float) -> dict[str, Any]:
        """The child's next message, which must be ``expect``; raises ChildFailed for an error
        report, a dead child or a timeout."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChildFailed(f"{self.name}: no {expect!r} within {timeout} s")
            ready = wait([self.conn, self.proc.sentinel], timeout=left)
            if self.conn in ready:
                try:
                    kind, payload = self.conn.recv()
                except EOFError:
                    raise ChildFailed(
                        f"{self.name} died (exit code {self.proc.exitcode})"
                    ) from None
                if kind == "error":
                    raise ChildFailed(f"{self.name} failed:\n{payload}")
                if kind != expect:
                    raise ChildFailed(f"{self.name}: expected {expect!r}, got {kind!r}")
                return payload
            if self.proc.sentinel in ready and not self.conn.poll(0.5):
                raise ChildFailed(f"{self.name} died (exit code {self.proc.exitcode})")

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit",))
            except (OSError, ValueError):
                pass
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def publish_all(pubs: list[Any], label: str, timeout: float) -> str:
    """Publishes ``label`` from every ``mx.Publisher`` of one process at once (each returns
    once every slot published) and returns the version id they agree on; the first error of
    any of them is raised."""
    with ThreadPoolExecutor(len(pubs)) as ex:
        ids = list(ex.map(lambda p: p.publish(label, timeout=timeout), pubs))
    if len(set(ids)) != 1:
        raise RuntimeError(f"{label}: the slots disagree on the version id: {ids}")
    return ids[0]


def run_example(
    name: str,
    run: Any,
    args: Any,
    repo: str,
    hold: tuple[str, ...],
    width: int = 8,
) -> int:
    """The end of an example's ``main``: ``run(args, work)`` in a fresh work directory under
    ``<repo>/.mx/tmp`` (kept with ``args.keep``), ``all_checks_hold`` = no ``failed_checks``
    and every report key in ``hold`` true, the report written to ``args.report`` and its
    versions, rollback and gathered bytes printed. Exit status 0 only when every check holds;
    1 when ``run`` raised (its traceback printed, a child's already is)."""
    import json
    import os
    import shutil
    import sys
    import tempfile

    os.makedirs(os.path.join(repo, ".mx", "tmp"), exist_ok=True)
    work = tempfile.mkdtemp(prefix=f"{name}-", dir=os.path.join(repo, ".mx", "tmp"))
    try:
        report = run(args, work)
    except Exception as e:
        print(f"{name}: FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        if not isinstance(e, ChildFailed):
            traceback.print_exc()
        return 1
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    report["all_checks_hold"] = not report["failed_checks"] and all(report[k] for k in hold)
    os.makedirs(os.path.dirname(os.path.abspath(args.report)), exist_ok=True)
    with open(args.report, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"\nreport: {args.report}")
    for v in [*report["versions"], report["rollback"]]:
        vid, verified = v["version_id"][:19], v["verified"]
        print(f"{v['label']:{width}} {vid}... {v['outcome']} verified={verified}")
    print(f"gathered_bytes: {report['gathered_bytes']} (training's own: ", end="")
    print(f"{report['training_gathered_bytes']})")
    print(f"seconds: {report['seconds']:.1f}")
    if not report["all_checks_hold"]:
        for line in report["failed_checks"]:
            print(f"  {line}", file=sys.stderr)
        print(f"{name}: FAILED", file=sys.stderr)
        return 1
    print(f"{name}: OK")
    return 0
