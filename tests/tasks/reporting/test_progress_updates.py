"""tasks/reporting/progress_updates.py: the progress artifact moved by logged steps, on the writer thread."""

import tasks.reporting.progress_updates as progress_updates
from tasks.reporting.progress_updates import ProgressUpdates


class Artifact:
    made = []

    def __init__(self, key, description):
        self.key, self.description, self.updates = key, description, []
        Artifact.made.append(self)

    def update(self, done, total):
        self.updates.append((done, total))


def progress(monkeypatch):
    monkeypatch.setattr(progress_updates, "StageProgress", Artifact)
    Artifact.made = []
    jobs = []

    def submit(job, what):  # the writer thread, run at once
        jobs.append(what)
        job()

    return ProgressUpdates("ppo", submit), jobs


def test_steps_move_the_artifact_of_total_steps_and_done_completes_it(monkeypatch):
    updates, jobs = progress(monkeypatch)
    updates.at(1)
    updates.advance(1, 2)
    assert Artifact.made == [] and jobs == []  # nothing before start
    updates.start(10, "PPO: 10 steps")
    updates.at(3)
    updates.done()
    [artifact] = Artifact.made
    assert (artifact.key, artifact.description) == ("ppo-progress", "PPO: 10 steps")
    assert artifact.updates == [(3, 10), (10, 10)] and jobs == ["the ppo progress"] * 2


def test_without_a_total_only_advance_moves_it(monkeypatch):
    updates, _ = progress(monkeypatch)
    updates.start(0, "Building the offline demo world", key="demo-world-progress")
    updates.at(5)
    updates.advance(2, 7)
    [artifact] = Artifact.made
    assert artifact.key == "demo-world-progress" and artifact.updates == [(2, 7)]
