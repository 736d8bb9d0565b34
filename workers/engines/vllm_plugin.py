"""A vLLM general plugin (entry point ``vllm.general_plugins``) run in each vLLM process.

vLLM's engine core is a child process. If the worker is SIGKILLed (OOM killer, a supervisor
that signals only the main pid), the child would live on holding the device and its memory.
Asking the kernel to kill the child when its parent dies closes that hole. Imports no vllm.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal

PR_SET_PDEATHSIG = 1


def register() -> None:
    if multiprocessing.parent_process() is None:
        return  # the worker itself, not one of vLLM's children
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before the signal was armed
        os._exit(1)
