"""What a thread that ran a backend must do before it ends.

MLX (>= 0.31.2) keeps each thread's streams in thread-local state. When a thread other than the
main one ends with its streams still alive, their teardown at thread exit can abort the whole
process later ("terminate called without an active exception", exit -6; ml-explore/mlx#3126).
MLX's remedy is ``mx.clear_streams()`` on the thread before it ends (ml-explore/mlx#3395; MLX's
own threaded tests do this). A loop here reproduced it: a thread that evaluated on the CPU
stream and ended without ``clear_streams`` aborted the process in 4 of 60 runs, 0 of 240 with it.
The main thread needs nothing (0 of 100 aborted), and stays usable.
"""

from __future__ import annotations

import sys
import threading


def release_thread_state() -> None:
    """Free the calling thread's framework state; call it last on a thread that ran a backend
    (a node's scheduler thread, on every way out). The thread must not run MLX afterwards
    (its streams are gone: MLX raises RuntimeError "There is no Stream..."). No-op on the main
    thread and where MLX was never imported (torch, vLLM)."""
    if threading.current_thread() is threading.main_thread():
        return
    mx = sys.modules.get("mlx.core")
    if mx is not None and hasattr(mx, "clear_streams"):  # MLX < 0.31.2: no per-thread streams
        mx.clear_streams()
