"""tasks/launch/ray_driver.py: what the driver refuses before it starts workers, and how a failure reads.

The driver on a (simulated) cluster is tests/distributed/test_ray_launcher.py."""

from ray.exceptions import ActorDiedError
from ray.train.v2.api.exceptions import WorkerGroupError

from tasks.launch.ray_driver import capacity_verdict, failure_sentence, hosts_of, local_store_verdict
from tasks.tracking.store import is_local_store


def node(address: str, alive: bool = True) -> dict:
    return {"NodeManagerAddress": address, "Alive": alive, "NodeID": address}


def test_a_store_on_this_machine_is_refused_only_when_the_nodes_span_several_hosts():
    one_host = [node("127.0.0.1"), node("127.0.0.1"), node("10.0.0.9", alive=False)]
    two_hosts = [node("10.0.0.1"), node("10.0.0.2")]
    assert hosts_of(one_host) == ["127.0.0.1"] and hosts_of(two_hosts) == ["10.0.0.1", "10.0.0.2"]
    assert local_store_verdict("sqlite:////data/mlflow.db", one_host, is_local_store) is None
    assert local_store_verdict("http://mlflow:5000", two_hosts, is_local_store) is None
    for uri in ("sqlite:////data/mlflow.db", "mlruns", "file:///data/mlruns"):
        verdict = local_store_verdict(uri, two_hosts, is_local_store)
        assert verdict.startswith(f"tracking.uri {uri} is a store on this machine only, and the Ray cluster's nodes")
        assert "on 2 hosts (10.0.0.1, 10.0.0.2)" in verdict and verdict.endswith("use a tracking server (http://...)")


def test_a_cluster_too_small_for_the_workers_is_named_with_the_fields_to_change():
    assert capacity_verdict({"CPU": 4.0}, 2, 2.0, 0.0) is None
    assert capacity_verdict({"CPU": 3.0}, 2, 2.0, 0.0) == (
        "run.num_processes 2 needs 4 CPU (2 workers x 2, run.ray_cpus_per_worker) but the cluster has 3; "
        "lower run.num_processes or add nodes"
    )
    assert "4 GPU (4 workers x 1, run.device cuda) but the cluster has 2" in capacity_verdict(
        {"CPU": 64.0, "GPU": 2.0}, 4, 1.0, 1.0
    )


def test_a_failure_after_the_restarts_is_one_sentence_with_the_first_worker_error():
    died = WorkerGroupError("Training failed.", {1: ActorDiedError(), 0: RuntimeError("boom\nsecond line")})
    sentence = failure_sentence("grpo", died, 2)
    assert (
        sentence
        == "the grpo stage failed on Ray after 2 restarts (run.max_failures 2): the worker of rank 0 failed: second line"
    )
    assert failure_sentence("reward", RuntimeError("controller lost"), 1) == (
        "the reward stage failed on Ray after 1 restart (run.max_failures 1): controller lost"
    )
