"""What code run in this process sets for the rest of it (a recipe run in-process, a module loaded at
collection): :func:`process_state_kept` puts it back."""

from __future__ import annotations

import contextlib
import os
import signal
import sys

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _torch_state() -> tuple | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    return (
        torch.get_default_dtype(),
        torch.get_num_threads(),
        torch.get_float32_matmul_precision(),
        torch.is_grad_enabled(),
    )


@contextlib.contextmanager
def process_state_kept():
    """Put back, on leaving, what code run inside set for the rest of its process: the environment, the
    working folder, the stop signals' handlers, and torch's default dtype, thread count, float32 matmul
    precision and grad mode (only what changed is set again)."""
    env, cwd, torch_state = dict(os.environ), os.getcwd(), _torch_state()
    handlers = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    try:
        yield
    finally:
        if os.environ != env:
            for name in set(os.environ) - set(env):
                del os.environ[name]
            os.environ.update(env)
        if os.getcwd() != cwd:
            os.chdir(cwd)
        for sig, handler in handlers.items():
            if signal.getsignal(sig) != handler and handler is not None:  # None: not installed from Python
                signal.signal(sig, handler)
        if torch_state is not None and _torch_state() != torch_state:
            import torch

            dtype, threads, precision, grad = torch_state
            torch.set_default_dtype(dtype)
            torch.set_num_threads(threads)
            torch.set_float32_matmul_precision(precision)
            torch.set_grad_enabled(grad)
