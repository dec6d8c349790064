"""The generators apart: the process samples exactly what our loop samples in the trainer from the same weights and
seed, scores it as the trainer would, samples each job with the version it names (and refuses one whose weights are
gone), fails its futures instead of hanging when it dies, and leaves nothing running; the thread loads a version
into its engine before the job that needs it. The rule that uses them: tests/rlhf_core/rl/test_samplers.py."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from rlhf_core.models.forward import response_logprobs
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.rollout.ahead import GeneratorError, Job, ProcessGenerator, ThreadGenerator, sample_job
from rlhf_core.rollout.collect import SamplingSpec
from rlhf_core.rollout.engines import LoopEngine
from rlhf_core.rollout.generation import left_pad, tokenize_prompts
from rlhf_core.rollout.sampling import SamplingSettings

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def parts(smoke_world):
    tokenizer = load_tokenizer(str(smoke_world.tokenizer))
    policy = load_causal_lm(str(smoke_world.base_model)).eval()
    ids = tokenize_prompts(tokenizer, ["the film was", "a story of", "i liked the"], 8)
    query_ids, query_mask = left_pad([i for i in ids for _ in range(2)], tokenizer.pad_token_id)
    spec = SamplingSpec(SamplingSettings(6, temperature=1.0), tokenizer.pad_token_id, (tokenizer.eos_token_id,), 2)
    return policy, query_ids, query_mask, spec


@pytest.fixture(scope="module")
def generator(parts):
    policy, _, _, spec = parts
    generator = ProcessGenerator(policy, spec, 2)
    yield generator
    generator.close()


def job(parts, version: int, seed: int = 123, step: int = 0) -> Job:
    _, query_ids, query_mask, _ = parts
    return Job(step, query_ids, query_mask, [{}] * len(query_ids), seed, version)


def in_trainer(policy, parts, seed: int = 123):
    """What the trainer's own loop samples from `policy` with the job's seed, and its log-probs of it."""
    torch.manual_seed(seed)
    sampled = sample_job(LoopEngine(), policy, job(parts, 0, seed), parts[3], "cpu")
    with torch.no_grad():
        logp, _ = response_logprobs(
            policy, sampled.query_ids, sampled.query_mask, sampled.responses, sampled.resp_mask, 1.0
        )
    return sampled, logp


def perturbed(policy):
    other = load_causal_lm(policy.name_or_path).eval()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return other


@pytest.mark.slow  # a generator process
def test_the_process_samples_what_our_loop_samples_with_the_same_weights_and_seed(parts, generator):
    policy = parts[0]
    generator.publish(policy, 0)
    made = generator.submit(job(parts, 0)).result(timeout=120)
    expected, logp = in_trainer(policy, parts)
    assert made.version == 0
    assert torch.equal(made.sampled.responses, expected.responses)
    assert torch.equal(made.sampled.resp_mask, expected.resp_mask)
    torch.testing.assert_close(made.sampled.behaviour_logprobs, logp, rtol=0, atol=1e-5)  # the behaviour log-probs


@pytest.mark.slow  # a generator process
def test_each_job_is_sampled_by_the_version_it_names_and_a_replaced_one_is_refused(parts, generator):
    policy = parts[0]
    other = perturbed(policy)
    generator.publish(policy, 0)
    generator.publish(other, 1)
    old, new = (generator.submit(job(parts, v, seed=7)).result(timeout=60) for v in (0, 1))
    assert torch.equal(old.sampled.responses, in_trainer(policy, parts, 7)[0].responses)
    assert torch.equal(new.sampled.responses, in_trainer(other, parts, 7)[0].responses)
    assert not torch.equal(old.sampled.behaviour_logprobs, new.sampled.behaviour_logprobs)
    generator.publish(other, 2)  # two places: version 2 takes version 0's
    with pytest.raises(GeneratorError, match="weights of version 0 for step 5 were replaced"):
        generator.submit(job(parts, 0, step=5)).result(timeout=60)


@pytest.mark.slow  # a generator process
def test_a_killed_process_fails_what_it_owed_and_close_leaves_nothing(parts):
    generator = ProcessGenerator(parts[0], parts[3], 1)
    generator.publish(parts[0], 0)
    generator.submit(job(parts, 0)).result(timeout=120)
    os.kill(generator.process.pid, signal.SIGKILL)
    with pytest.raises(GeneratorError, match="generator process exited"):
        generator.submit(job(parts, 0)).result(timeout=30)
    generator.close()
    assert not generator.process.is_alive() and not generator.reader.is_alive()


@pytest.mark.slow  # a generator process
def test_cancel_drops_queued_jobs_unanswered(parts, generator):
    generator.publish(parts[0], 0)
    futures = [generator.submit(job(parts, 0, seed=s)) for s in range(4)]
    generator.cancel()
    assert all(f.cancelled() for f in futures)
    made = generator.submit(job(parts, 0)).result(timeout=60)  # answers after a cancel are the new jobs'
    assert torch.equal(made.sampled.responses, in_trainer(parts[0], parts)[0].responses)


class StagedLoop:
    """An engine apart over its own model copy: `stage` snapshots the policy into a place, `load_staged` takes a
    place into the copy (slowly); records what it loaded."""

    def __init__(self, policy, delay: float = 0.0):
        self.model, self.places, self.loads, self.delay = perturbed(policy), {}, [], delay

    def stage(self, policy, slot=None):
        self.places[slot] = {k: v.clone() for k, v in policy.state_dict().items()}

    def load_staged(self, slot=None):
        time.sleep(self.delay)
        self.model.load_state_dict(self.places[slot])
        self.loads.append(slot)

    def generate(self, policy, *args, **kwargs):
        return LoopEngine().generate(self.model, *args, **kwargs)


def test_the_thread_loads_a_version_before_the_job_that_needs_it_once(parts):
    policy, other = parts[0], perturbed(parts[0])
    engine = StagedLoop(policy, delay=0.05)
    generator = ThreadGenerator(engine, parts[3], 2)
    try:
        generator.publish(policy, 0)
        generator.publish(other, 1)
        torch.manual_seed(0)
        made = [generator.submit(job(parts, v, seed=v)).result(timeout=60) for v in (0, 0, 1)]
        assert engine.loads == [0, 1] and [m.version for m in made] == [0, 0, 1]
        generator.publish(other, 2)
        with pytest.raises(GeneratorError, match="version 0 for step 0 were replaced"):
            generator.submit(job(parts, 0)).result(timeout=60)
    finally:
        generator.close()


def test_places_go_in_turn_whatever_the_versions_so_pushes_every_n_steps_keep_the_last_k_plus_one(parts):
    """vLLM pushed every 2 steps publishes versions 0, 2, 4: two places keep versions 2 and 4 (not version % 2)."""
    policy = parts[0]
    engine = StagedLoop(policy)
    generator = ThreadGenerator(engine, parts[3], 2)
    try:
        for version in (0, 2, 4):
            generator.publish(policy, version)
        made = [generator.submit(job(parts, v)).result(timeout=60) for v in (2, 4)]
        assert [m.version for m in made] == [2, 4] and engine.loads == [1, 0]
    finally:
        generator.close()


TRAINER = """
import sys, time
import torch
from rlhf_core.models.loading import load_causal_lm
from rlhf_core.rollout.ahead import Job, ProcessGenerator
from rlhf_core.rollout.collect import SamplingSpec
from rlhf_core.rollout.sampling import SamplingSettings

if __name__ == "__main__":
    policy = load_causal_lm(sys.argv[1])
    generator = ProcessGenerator(policy, SamplingSpec(SamplingSettings(4), 0, (1,)), 1)
    generator.publish(policy, 0)
    ids = torch.ones(1, 3, dtype=torch.long)
    generator.submit(Job(0, ids, ids, [{}], 1, 0)).result(timeout=300)  # started, and waiting for work
    print(generator.process.pid, flush=True)
    time.sleep(600)
"""


def running(pid: int) -> bool:
    """The process exists and has not exited (a zombie that nothing reaps has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow  # a generator process
def test_a_trainer_killed_with_sigkill_takes_its_generator_process_with_it(smoke_world, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    trainer = subprocess.Popen(
        [sys.executable, str(script), str(smoke_world.base_model)], stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(trainer.stdout.readline())
        assert running(child)
        trainer.kill()  # SIGKILL: no handler, no atexit
        trainer.wait()
        deadline = time.monotonic() + 30  # it looks every second
        while time.monotonic() < deadline:
            if not running(child):
                return
            time.sleep(0.2)
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the generator process outlived its trainer by 30 s")
    finally:
        trainer.kill()


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.slow  # a generator process
def test_generators_fork_from_one_forkserver_that_imported_the_decode_loop_once(parts, generator):
    """A second generator (a rollback's, a resume's) is forked from the same forkserver as the first, whose
    command line names the modules it imported once for all of them."""
    later = ProcessGenerator(parts[0], parts[3], 1)
    try:
        later.publish(parts[0], 0)
        later.submit(job(parts, 0)).result(timeout=120)
        server = parent_of(generator.process.pid)
        assert parent_of(later.process.pid) == server != os.getpid()
        command = Path(f"/proc/{server}/cmdline").read_bytes().decode()
        assert "multiprocessing.forkserver" in command
        assert "'rlhf_core.rollout.ahead', 'transformers.modeling_utils'" in command
    finally:
        later.close()
    assert not later.process.is_alive()
