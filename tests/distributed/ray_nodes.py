"""A Ray cluster of several nodes on this machine, for the tests (one CPU per node), and a node that
does not share the run directory.

`start_cluster` is `ray.cluster_utils.Cluster`: a head node (with the dashboard, which serves the state
API) and more worker nodes, each a raylet of its own, all on 127.0.0.1. What differs from a real cluster:
the nodes share this machine's file system, environment and host address. Everything Ray writes for it
stays in a directory of the caller's (`ray_temp_root()`), never in the machine's /tmp/ray.

`blind_node(...)` starts one more node in a mount namespace of its own (`unshare --mount`) with an empty
tmpfs mounted over a given directory: processes on that node see their own, private directory at the
same path, as a node of a real cluster does when the run directory is not on shared storage. Run as a
script, this module is that node: `python ray_nodes.py <gcs address> <temp dir> <private dir>`; it runs
until its standard input closes. Needs root or CAP_SYS_ADMIN (skipped elsewhere).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from rlhf_core.rollout.vllm_server import free_port

OBJECT_STORE = 150 * 1024**2  # bytes per node; the tests move only small objects
# Ray's Unix sockets live at <temp dir>/session_<date>_<time>_<microseconds>_<pid>/sockets/plasma_store.N, and
# a socket path must stay under 108 bytes: what that leaves for the directory `ray_temp_root` makes (base + 10)
# and Ray's "/ray" below it
SOCKET_PATH_ROOM = 27


def ray_temp_root() -> Path:
    """A new, empty directory for Ray's files (RAY_TMPDIR): under $TMPDIR when that path is short enough for
    Ray's socket paths, else under /tmp."""
    base = tempfile.gettempdir()
    return Path(tempfile.mkdtemp(prefix="r", dir=base if len(base) <= SOCKET_PATH_ROOM else "/tmp"))


@contextmanager
def ray_tmpdir(root: Path):
    """RAY_TMPDIR set to `root` while it lasts, and put back after."""
    previous = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = str(root)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = previous


def start_cluster(root: Path, nodes: int = 2):
    """A cluster of `nodes` nodes of one CPU each, its files in `root`/ray (its nodes' temp dir); the caller
    stops it with `stop_cluster(cluster, root)`.

    `Cluster` writes its address file (ray_current_cluster) into Ray's default temp dir, $RAY_TMPDIR/ray,
    whatever temp dir its nodes have, and does not create that directory: RAY_TMPDIR names `root` while the
    cluster starts, so that the default is the nodes' own, which the head node creates. Ray installs SIGTERM
    and SIGINT handlers in the process that starts nodes; the test process's own are put back (other tests
    install and check theirs)."""
    from ray.cluster_utils import Cluster

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    common = {"num_cpus": 1, "object_store_memory": OBJECT_STORE}
    try:
        with ray_tmpdir(root):
            cluster = Cluster(
                initialize_head=True,
                # a free port for the dashboard: a Ray of the machine's own may hold the default 8265
                head_node_args={
                    **common,
                    "include_dashboard": True,
                    "dashboard_port": free_port(),
                    "temp_dir": str(root / "ray"),
                },
            )
            for _ in range(nodes - 1):
                cluster.add_node(**common)
            cluster.wait_for_nodes()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return cluster


def stop_cluster(cluster, root: Path) -> None:
    """Every node of `cluster` stopped; `Cluster.shutdown` removes the address file from $RAY_TMPDIR/ray, which
    is `root`'s while it runs (not whatever instance the machine's /tmp/ray names)."""
    with ray_tmpdir(root):
        cluster.shutdown()


def alive_nodes(address: str) -> list[str]:
    """The ids of the alive nodes of the cluster at `address` (the state API; no driver connects)."""
    from ray.util.state import list_nodes

    return [
        n.node_id for n in list_nodes(address=address, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False)
    ]


def can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0


@contextmanager
def blind_node(gcs_address: str, temp_dir: Path, private: Path, timeout_s: float = 60.0):
    """One more node whose processes see an empty, private `private` directory; yields its node id."""
    before = set(alive_nodes(gcs_address))
    proc = subprocess.Popen(
        [sys.executable, __file__, gcs_address, str(temp_dir), str(private)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            new = [n for n in alive_nodes(gcs_address) if n not in before]
            if new:
                break
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the blind node did not join the cluster"
            time.sleep(0.5)
        yield new[0]
    finally:
        proc.stdin.close()  # the node shuts down when its standard input closes
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _run_node(gcs_address: str, temp_dir: str, private: str) -> None:
    """Inside the namespace: the tmpfs over `private`, then a Ray node that lives until stdin closes."""
    import ray._private.node
    from ray._private.parameter import RayParams

    Path(private).mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", private], check=True)
    params = RayParams(
        gcs_address=gcs_address,
        num_cpus=1,
        node_ip_address="127.0.0.1",
        temp_dir=temp_dir,
        object_store_memory=OBJECT_STORE,
        min_worker_port=0,
        max_worker_port=0,
        include_log_monitor=False,
        node_manager_port=0,
        dashboard_agent_listen_port=None,
    )
    node = ray._private.node.Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
    print("joined", flush=True)
    sys.stdin.read()
    node.kill_all_processes(check_alive=False, allow_graceful=True)


if __name__ == "__main__":
    if os.environ.get("RLHF_BLIND_NODE") != "1":  # re-run this script in a mount namespace of its own
        env = {**os.environ, "RLHF_BLIND_NODE": "1"}
        os.execvpe("unshare", ["unshare", "--mount", "--propagation", "private", sys.executable, *sys.argv], env)
    _run_node(*sys.argv[1:4])
