"""`python rlhf_vllm_supervisor.py OWNER_PID COMMAND...`: runs COMMAND (the vLLM server) as its child and stops it
when process OWNER_PID is gone, killed with SIGKILL or not, so that no server outlives the run that started it.
Started in a session of its own, it leads the process group that the server and vLLM's engine processes join;
the owner stops them all with one signal to that group. Standard library only: it runs in the vLLM environment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5
GRACE_S = 10.0


def main(owner: int, command: list[str]) -> int:
    child = subprocess.Popen(command)
    while child.poll() is None:
        if os.getppid() != owner:  # re-parented: the owner is gone (its pid may already be reused)
            child.terminate()
            try:
                child.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            os.killpg(os.getpgrp(), signal.SIGKILL)  # the engine processes too, and this one
        time.sleep(POLL_S)
    return child.returncode


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2:]))
