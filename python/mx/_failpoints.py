"""Test hooks of mx's code inside engines (the vLLM backend, the SGLang loader): a failpoint
file, named by an environment variable the engine process was started with, arms the next
install once. Nothing happens unless the variable is set; the file is consumed when read.

The file holds ``install_after:<N>`` (the install raises after feeding N tensors to the
engine's loader) or ``die_after:<N>`` (the whole engine's process group is SIGKILLed there).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterable, Iterator
from typing import Any

logger = logging.getLogger("mx.failpoints")


def take(env_var: str) -> tuple[str, int] | None:
    """The failpoint armed in the file ``$env_var`` names, consuming it; ``None`` when unset or
    absent.

    Raises:
        ValueError: the file holds something else than ``install_after:<N>`` or
            ``die_after:<N>``.
    """
    path = os.environ.get(env_var)
    if not path:
        return None
    try:
        with open(path) as f:
            spec = f.read().strip()
        os.unlink(path)
    except FileNotFoundError:
        return None
    name, _, n = spec.partition(":")
    if name not in ("install_after", "die_after") or not (n.isascii() and n.isdigit()):
        raise ValueError(f"{path}: {spec!r} is not install_after:<N> or die_after:<N>")
    logger.warning("mx: failpoint %s armed for this install", spec)
    return name, int(n)


def fail_after(items: Iterable[Any], failpoint: tuple[str, int]) -> Iterator[Any]:
    """``items`` until the failpoint's N-th: then a ``RuntimeError`` (``install_after``) or a
    SIGKILL of this process group (``die_after``)."""
    name, limit = failpoint
    for i, item in enumerate(items):
        if i == limit:
            if name == "die_after":
                # The whole server: its process group (API server, engine core, workers).
                logger.warning("mx: failpoint %s: SIGKILL of process group %d", name, os.getpgrp())
                os.killpg(os.getpgrp(), signal.SIGKILL)
            raise RuntimeError(f"mx failpoint {name}:{limit}: failing the install")
        yield item
