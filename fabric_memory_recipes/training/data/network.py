"""Is the network there? Asked once, quickly, so offline machines fall back instead of hanging."""

from __future__ import annotations

import functools
import os
import socket
import threading


def _connect(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


@functools.cache
def reachable(host: str, port: int = 443, timeout: float = 3.0) -> bool:
    """True if a TCP connection to ``host:port`` opens within ``timeout`` seconds.

    The name lookup runs in a worker thread so that a resolver with no server to ask cannot block the
    caller past ``timeout``. ``FMR_OFFLINE=1`` answers False without asking (tests use it).
    """
    if os.environ.get("FMR_OFFLINE", "") not in ("", "0"):
        return False
    result: list[bool] = []
    # A daemon thread, not an executor: interpreter exit must not wait for a hung lookup.
    worker = threading.Thread(target=lambda: result.append(_connect(host, port, timeout)), daemon=True)
    worker.start()
    worker.join(timeout)
    return bool(result and result[0])


def hub_online() -> bool:
    """Whether the Hugging Face hub may be used: HF_HUB_OFFLINE is unset (or 0) and huggingface.co
    answers. The weights, the tokenizer and IMDb through ``datasets`` all take this one decision."""
    return os.environ.get("HF_HUB_OFFLINE", "") in ("", "0") and reachable("huggingface.co")
