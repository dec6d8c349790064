"""tasks/launch/ray_driver.py: what the driver refuses before it starts workers, and how a failure reads.

The driver on a (simulated) cluster is tests/distributed/test_ray_launcher.py."""

from types import SimpleNamespace

import pytest
import torch
from ray.exceptions import ActorDiedError
from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError
from ray.train.v2._internal.execution.failure_handling import FailureDecision
from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError
from safetensors.torch import save_file

from rlhf_core.models.loading import ModelSourceError
from rlhf_core.storage.checkpoints import STATE_DIR, STATE_JSON, TENSORS
from tasks.launch.ray_callback import StageLost, StageRefused, StageStory, death_cause, first_failure
from tasks.launch.ray_driver import (
    StageFailure,
    StageRefusal,
    capacity_verdict,
    failure_sentence,
    hosts_of,
    local_store_verdict,
    stage_failure,
)
from tasks.launch.story import (
    FAILURE_PREFIX,
    REFUSAL_PREFIX,
    STORY_PREFIX,
    ConsoleFilter,
    failure_line,
    loss_line,
    node_label,
    resume_step,
    start_line,
)
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


def test_a_failure_after_the_restarts_is_one_sentence_naming_the_worker_gone_first():
    died = WorkerGroupError("Training failed.", {1: ActorDiedError(), 0: RuntimeError("boom\nsecond line")})
    assert failure_sentence("grpo", died, 2) == (
        "the grpo stage failed on Ray after 2 restarts (run.max_failures 2): rank 1 lost: its process died (killed, "
        "or crashed)"
    )
    failed = WorkerGroupError("Training failed.", {1: RuntimeError("gloo: Connection reset"), 0: KeyError("x")})
    assert failure_sentence("grpo", failed, 0).endswith(
        "after 0 restarts (run.max_failures 0): rank 0 failed: KeyError: 'x'"
    )
    assert failure_sentence("reward", RuntimeError("controller lost"), 1) == (
        "the reward stage failed on Ray after 1 restart (run.max_failures 1): controller lost"
    )
    # the controller's own sentences, raised through Ray Train's ControllerError
    refused = stage_failure("rl", ControllerError(StageRefused("data.prompts row 3: empty")), 2)
    assert isinstance(refused, StageRefusal) and str(refused) == "data.prompts row 3: empty"
    lost = stage_failure("rl", ControllerError(StageLost("the rl stage failed on Ray after 1 restart ...")), 1)
    assert type(lost) is StageFailure and str(lost) == "the rl stage failed on Ray after 1 restart ..."


class FakeWorkerGroup:
    """What `StageStory` reads of Ray Train's WorkerGroup: its workers' ranks and where they run."""

    def __init__(self, *nodes: str):
        self.workers = [
            SimpleNamespace(
                distributed_context=SimpleNamespace(world_rank=rank),
                metadata=SimpleNamespace(node_id=f"{node}0123456789abcdef", hostname=node, node_ip=f"10.0.0.{rank}"),
            )
            for rank, node in enumerate(nodes)
        ]

    def get_workers(self):
        return self.workers


def test_the_controller_says_each_start_and_loss_and_ends_the_stage_on_a_user_error(tmp_path, capsys):
    save_tiny_checkpoint(tmp_path / "checkpoint-2")
    story = StageStory("rl", 1, str(tmp_path))
    story.after_worker_group_start(FakeWorkerGroup("gpu-a", "gpu-b"))
    gone = WorkerHealthCheckFailedError("A worker health check failed.", ActorDiedError())
    story.after_worker_group_poll_status(SimpleNamespace(errors={0: RuntimeError("gloo: Connection reset"), 1: gone}))
    story.before_controller_execute_failure_decision(FailureDecision.RETRY)
    story.after_worker_group_start(FakeWorkerGroup("gpu-b", "gpu-c"))
    printed = capsys.readouterr().out.splitlines()
    assert printed == [
        STORY_PREFIX + "rl stage: 2 workers started: rank 0 on node gpu-a0123456 (gpu-a, 10.0.0.0), rank 1 on node "
        "gpu-b0123456 (gpu-b, 10.0.0.1)",
        STORY_PREFIX + "rl stage: rank 1 on node gpu-b0123456 (gpu-b, 10.0.0.1) lost: its process died (killed, or "
        "crashed); restarting the workers from checkpoint 2 (restart 1 of 1)",
        STORY_PREFIX + "rl stage: 2 workers restarted (restart 1 of 1): rank 0 on node gpu-b0123456 (gpu-b, 10.0.0.0), "
        "rank 1 on node gpu-c0123456 (gpu-c, 10.0.0.1)",
    ]
    # the restarts used up: the last sentence, raised for the driver (it becomes Ray Train's ControllerError)
    story.after_worker_group_poll_status(SimpleNamespace(errors={0: gone}))
    with pytest.raises(StageLost) as lost:
        story.before_controller_execute_failure_decision(FailureDecision.RAISE)
    assert str(lost.value) == (
        "the rl stage failed on Ray after 1 restart (run.max_failures 1): rank 0 on node gpu-b0123456 (gpu-b, "
        "10.0.0.0) lost: its process died (killed, or crashed)"
    )
    # a user error in any worker: no restart, whatever run.max_failures allows; the worker's sentence
    story = StageStory("reward", 5, None)
    story.after_worker_group_start(FakeWorkerGroup("gpu-a", "gpu-b"))
    refusal = ModelSourceError("reward.base /models/rm is not a directory\n  nor a hub name")
    story.after_worker_group_poll_status(SimpleNamespace(errors={0: RuntimeError("gloo"), 1: refusal}))
    with pytest.raises(StageRefused, match=r"^reward.base /models/rm is not a directory nor a hub name$"):
        story.before_controller_execute_failure_decision(FailureDecision.RETRY)
    # a failure of Ray's own (no worker error to name): the driver's sentence
    story = StageStory("reward", 5, None)
    story.before_controller_execute_failure_decision(FailureDecision.RAISE)
    assert "lost" not in capsys.readouterr().out


def test_a_dead_worker_reads_as_lost_and_an_exception_as_failed():
    assert death_cause(WorkerHealthCheckFailedError("check failed", ActorDiedError())) == (
        True,
        "its process died (killed, or crashed)",
    )
    assert death_cause(ValueError("bad\nlast line")) == (False, "ValueError: last line")
    assert first_failure({0: RuntimeError("collective aborted"), 2: ActorDiedError()})[:2] == (2, True)


# the console's story (tasks/launch/story.py) and the controller's callback (tasks/launch/ray_callback.py) ----------

RAY_OUTPUT = """\
2026-11-27 12:19:18,949\tINFO worker.py:1691 -- Using address 192.0.2.2:6411 set in the environment variable RAY_ADDRESS
rlhf-story: rl stage: joined the Ray cluster at 192.0.2.2:6411: 2 nodes, 2 CPUs
(TrainController pid=22914) Attempting to start training worker group of size 2 with the following resources: [{'CPU': 1.0}] * 2
(TrainController pid=22914) [2026-11-27 12:29:24,836 E 22914 22946] core_worker.cc:2465: Actor with class name: 'PreemptionWatcher' has constructor arguments in the object store
(TrainController pid=22914) rlhf-story: rl stage: 2 workers started: rank 0 on node 864f6921c2d6 (vm, 10.0.0.2), rank 1 on node 0ecc9fa5d104 (vm, 10.0.0.3)
(TrainController pid=22914) rlhf-story: rl stage: 2 workers started: rank 0 on node 864f6921c2d6 (vm, 10.0.0.2), rank 1 on node 0ecc9fa5d104 (vm, 10.0.0.3)
(RayTrainWorker pid=23067) [rank 0] eval at step 1: eval/score_mean=0.008
(RayTrainWorker pid=23067, ip=10.0.0.2) [rank 0] eval at step 1: eval/score_mean=0.008
(RayTrainWorker pid=23002) grpo:  25%|██▌       | 1/4 [00:00<00:00,  9.93it/s]
(raylet) A worker died or was killed while executing a task by an unexpected system error.
(RayTrainWorker pid=23002) Traceback (most recent call last):
(RayTrainWorker pid=23002) RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:23942: Connection reset by peer.
(TrainController pid=22914) [FailurePolicy] RETRY
(TrainController pid=22914) rlhf-story: rl stage: rank 1 on node 0ecc9fa5d104 (vm, 10.0.0.3) lost: its process died (killed, or crashed); restarting the workers from checkpoint 1 (restart 1 of 1)
(TrainController pid=22914) rlhf-story: rl stage: 2 workers restarted (restart 1 of 1): rank 0 on node 0ecc9fa5d104 (vm, 10.0.0.3), rank 1 on node 864f6921c2d6 (vm, 10.0.0.2)
(RayTrainWorker pid=23453) [rank 0] the rl stage resumes from checkpoint 1
(RayTrainWorker pid=23453) [rank 0] the rl stage resumes from checkpoint 1
(RayTrainWorker pid=23453) [rank 1] on node 0ecc9fa5d104 (vm, 10.0.0.3) [repeated 3x across cluster] (Ray deduplicates logs by default.)
"""


def test_the_console_keeps_the_story_and_the_workers_own_lines_each_once_and_nothing_of_rays():
    console = ConsoleFilter()
    shown = [line for raw in RAY_OUTPUT.splitlines() if (line := console.keep(raw)) is not None]
    assert shown == [
        "rl stage: joined the Ray cluster at 192.0.2.2:6411: 2 nodes, 2 CPUs",
        "rl stage: 2 workers started: rank 0 on node 864f6921c2d6 (vm, 10.0.0.2), rank 1 on node 0ecc9fa5d104 (vm, 10.0.0.3)",
        "[rank 0] eval at step 1: eval/score_mean=0.008",
        "rl stage: rank 1 on node 0ecc9fa5d104 (vm, 10.0.0.3) lost: its process died (killed, or crashed); restarting the "
        "workers from checkpoint 1 (restart 1 of 1)",
        "rl stage: 2 workers restarted (restart 1 of 1): rank 0 on node 0ecc9fa5d104 (vm, 10.0.0.3), rank 1 on node "
        "864f6921c2d6 (vm, 10.0.0.2)",
        "[rank 0] the rl stage resumes from checkpoint 1",
        "[rank 1] on node 0ecc9fa5d104 (vm, 10.0.0.3)",
    ]
    assert console.failure is None and console.refusal is None
    # the last words, said by the driver or by the controller (through Ray's prefix)
    assert console.keep("(TrainController pid=1) " + REFUSAL_PREFIX + "reward.base /x is not a directory") is None
    assert console.keep(FAILURE_PREFIX + "the rl stage failed on Ray after 0 restarts") is None
    assert console.refusal == "reward.base /x is not a directory"
    assert console.failure == "the rl stage failed on Ray after 0 restarts"
    # torchrun's processes print only their own lines: all of them, twice if they say it twice
    local = ConsoleFilter(story_only=False)
    assert [local.keep(line) for line in ("loss=1.0", "loss=1.0", "(x) y")] == ["loss=1.0", "loss=1.0", "(x) y"]
    assert local.keep(FAILURE_PREFIX + "boom") is None and local.failure == "boom"


def test_the_story_lines_name_ranks_nodes_restarts_and_the_checkpoint(tmp_path):
    placed = {
        1: node_label("0ecc9fa5d104aaaa", "gpu-2", "10.0.0.3"),
        0: node_label("864f6921c2d6bbbb", "gpu-1", "10.0.0.2"),
    }
    assert start_line("rl", 1, 2, placed) == (
        "rl stage: 2 workers started: rank 0 on node 864f6921c2d6 (gpu-1, 10.0.0.2), rank 1 on node 0ecc9fa5d104 "
        "(gpu-2, 10.0.0.3)"
    )
    assert start_line("rl", 3, 2, {0: "node a (h, ip)"}).startswith("rl stage: 1 worker restarted (restart 2 of 2): ")
    assert loss_line("reward", 1, placed[1], "its node was lost", 1, 1, None) == (
        "reward stage: rank 1 on node 0ecc9fa5d104 (gpu-2, 10.0.0.3) lost: its node was lost; restarting the workers "
        "from the start (no checkpoint yet) (restart 1 of 1)"
    )
    assert failure_line("rl", "rank 0 on n lost: x", 1, 1) == (
        "the rl stage failed on Ray after 1 restart (run.max_failures 1): rank 0 on n lost: x"
    )
    # the newest complete checkpoint in the stage's directory
    assert resume_step(tmp_path / "absent") is None and resume_step(tmp_path) is None and resume_step(None) is None
    for step in (1, 3):
        save_tiny_checkpoint(tmp_path / f"checkpoint-{step}")
    (tmp_path / "checkpoint-5").mkdir()  # begun, never completed
    assert resume_step(tmp_path) == 3


def save_tiny_checkpoint(path):
    """A directory that reads as a complete checkpoint: a model file and the training state."""
    state = path / STATE_DIR
    state.mkdir(parents=True)
    save_file({"w": torch.zeros(1)}, str(path / "model.safetensors"))
    save_file({"w": torch.zeros(1)}, str(state / TENSORS))
    (state / STATE_JSON).write_text("{}")
