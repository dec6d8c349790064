"""Generators apart from the trainer, for generation ahead of training (rollout.max_staleness > 0): each takes
jobs (one step's prompts and the policy version to sample them with) in order, one at a time, and answers with what
it sampled and which version sampled it (`rl/samplers.py` decides what to ask and what to keep). A job names its
version, rather than taking the newest, so that a run is the same run every time: the trainer publishes each version
into the next of `slots` places in turn (max_staleness + 1: a queued job's version is one of the last k + 1
published), and a job reads the place that holds its version.

- `ThreadGenerator`: an engine with a server of its own (vllm), fed from one thread of the trainer's process. The
  sampling is the server's; the thread only waits on it, and it alone loads weights into the server, between jobs.
- `ProcessGenerator`: our decode loop (hf) in a process of its own, holding its own copy of the policy; the trainer
  publishes its weights into shared memory, and the process copies them in between jobs. A process rather than a
  thread: a small model's decode step is mostly Python, and a thread would hold the interpreter lock the trainer
  needs. The process also keeps its samples' log-probs (the behaviour policy of the correction, from its decode
  loop) and plays tool episodes, so their tools run in it.

`publish(policy, version)` runs on the trainer; `submit(job)` returns a Future of `Made`; `cancel()` drops every job
not yet answered (their answers are discarded); `close()` stops the generator, whatever it was doing. Publishing and
reading a place hold one lock, and a job whose version is no longer in its place fails rather than sample from
other weights.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import count
from typing import Protocol

import torch

from rlhf_core.rollout.collect import Sampled, SamplingSpec, sample
from rlhf_core.rollout.engines import LoopEngine, engine_weights

CLOSE_TIMEOUT_S = 30.0
# what a generator process needs before its first job, imported once by the forkserver it forks from
PRELOAD = ("rlhf_core.rollout.ahead", "transformers.modeling_utils")


class GeneratorError(RuntimeError):
    """The generator apart failed (its process died, or sampling raised there)."""


@dataclass(frozen=True)
class Job:
    step: int  # the RL step this rollout is for
    query_ids: torch.Tensor  # (B, Q) on the CPU
    query_mask: torch.Tensor
    rows: list[dict]  # each row's prompt row (tool episodes read the messages)
    seed: int
    version: int  # the policy version to sample with (published before the job is submitted)


@dataclass
class Made:
    sampled: Sampled
    version: int  # the policy version (RL steps trained) whose weights sampled it
    waited_s: float  # seconds the generator sat idle before this job: no job was due until newer weights came


def sample_job(engine, policy, job: Job, spec: SamplingSpec, device) -> Sampled:
    """`job`'s prompts sampled as the step would sample them (`collect.sample`), seeded with the job's seed."""
    return sample(
        engine, policy, job.query_ids.to(device), job.query_mask.to(device), spec, seed=job.seed, rows=job.rows
    )


class Generator(Protocol):
    def publish(self, policy, version: int) -> None: ...

    def submit(self, job: Job) -> Future: ...

    def cancel(self) -> None: ...

    def close(self) -> None: ...


class StagedEngine(Protocol):
    """An engine whose weights are handed over in two halves: `stage(policy, slot)` on the trainer (a snapshot in
    place `slot`), `load_staged(slot)` on the generator's thread (the engine takes it). `rollout/engines.py`
    VllmEngine."""

    def generate(self, policy, query_ids, query_mask, settings, **kwargs): ...

    def stage(self, policy, slot: int | None = None) -> None: ...

    def load_staged(self, slot: int | None = None) -> None: ...


def place_of(job: Job, versions) -> int:
    """The place that holds `job`'s version (`versions`: each place's); a GeneratorError when none does any more."""
    for slot, version in enumerate(versions):
        if version == job.version:
            return slot
    raise GeneratorError(f"the weights of version {job.version} for step {job.step} were replaced ({list(versions)})")


class ThreadGenerator:
    """`engine` fed from one thread; weights staged by `publish` into one of `slots` places, loaded by the thread
    before a job that needs them."""

    def __init__(self, engine: StagedEngine, spec: SamplingSpec, slots: int):
        self.engine, self.spec = engine, spec
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead")
        self.lock = threading.Lock()  # a place is written whole before the thread loads it
        self.staged, self.published = [-1] * slots, 0  # each place's version; how many were published
        self.loaded: int | None = None
        self.idle_since = time.perf_counter()
        self.futures: list[Future] = []

    def publish(self, policy, version: int) -> None:
        with self.lock:
            slot = self.published % len(self.staged)
            self.engine.stage(policy, slot)
            self.staged[slot] = version
            self.published += 1

    def submit(self, job: Job) -> Future:
        future = self.pool.submit(self._run, job)
        self.futures = [f for f in self.futures if not f.done()] + [future]  # what cancel() may still stop
        return future

    def _run(self, job: Job) -> Made:
        waited = time.perf_counter() - self.idle_since
        try:
            with self.lock:
                if self.loaded != job.version:
                    self.engine.load_staged(place_of(job, self.staged))
                    self.loaded = job.version
            return Made(sample_job(self.engine, None, job, self.spec, "cpu"), job.version, waited)
        finally:
            self.idle_since = time.perf_counter()

    def cancel(self) -> None:
        for future in self.futures:
            future.cancel()  # the one running finishes; its answer is not read
        self.futures = []

    def close(self) -> None:
        self.cancel()
        self.pool.shutdown(wait=True, cancel_futures=True)


def generator_context():
    """How generator processes start: from a forkserver that imported torch, transformers and this module once
    (`PRELOAD`), so that the first generator of a process pays for those imports (seconds) and every later one
    (a rollback's, a resume's, the next test's) forks in milliseconds; spawn where the platform has no
    forkserver. Never a plain fork: the trainer holds threads (torch's, the generator's reader). A generator's
    parent is then the forkserver, but `next_job` watches the trainer, which `parent_process()` names under
    both methods."""
    import torch.multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))  # read when the forkserver starts (the first generator)
    return context


class ProcessGenerator:
    """Our decode loop in a process of its own (`generator_context`) with its own copy of `policy` (LoRA merged), on
    `device`, with `threads` torch threads. Weights travel through `slots` places in shared memory, jobs and answers
    through queues; a reader thread here resolves the futures, and fails them all if the process dies."""

    def __init__(self, policy, spec: SamplingSpec, slots: int, *, device="cpu", threads: int = 1):
        context = generator_context()
        state = engine_weights(policy)
        self.places = [{k: v.clone().share_memory_() for k, v in state.items()} for _ in range(slots)]
        self.versions = context.Array("q", [-1] * slots, lock=False)  # each place's version
        self.published = 0
        self.lock = context.Lock()
        self.skip_below = context.Value("q", 0)  # jobs numbered below it are dropped unanswered
        self.jobs, self.answers = context.Queue(), context.Queue()
        config = (policy.get_base_model() if hasattr(policy, "peft_config") else policy).config
        shared = Shared(self.places, self.versions, self.lock, self.skip_below, self.jobs, self.answers)
        self.process = context.Process(
            target=serve,
            args=(config, shared, spec),
            kwargs={"device": str(device), "threads": threads},
            name="rollout-ahead",
            daemon=True,
        )
        self.process.start()
        self.numbers = count()
        self.futures: dict[int, Future] = {}
        self.closing = threading.Event()
        self.reader = threading.Thread(target=self._read, name="rollout-ahead-reader", daemon=True)
        self.reader.start()

    def publish(self, policy, version: int) -> None:
        slot = self.published % len(self.places)
        self.published += 1
        with self.lock:
            for name, value in engine_weights(policy).items():
                self.places[slot][name].copy_(value)
            self.versions[slot] = version

    def submit(self, job: Job) -> Future:
        number = next(self.numbers)
        future: Future = Future()
        self.futures[number] = future
        self.jobs.put((number, job))
        return future

    def _read(self) -> None:
        while not self.closing.is_set():
            try:
                number, answer = self.answers.get(timeout=0.2)
            except queue.Empty:
                if not self.process.is_alive():
                    self._fail_all(GeneratorError(f"the generator process exited (code {self.process.exitcode})"))
                    return
                continue
            future = self.futures.pop(number, None)
            if future is None or future.cancelled():
                continue
            if isinstance(answer, BaseException):
                future.set_exception(answer)
            else:
                future.set_result(answer)

    def _fail_all(self, error: Exception) -> None:
        for future in self.futures.values():
            if not future.done():
                future.set_exception(error)
        self.futures = {}

    def cancel(self) -> None:
        self.skip_below.value = next(self.numbers)
        for future in self.futures.values():
            future.cancel()
        self.futures = {}

    def close(self) -> None:
        self.cancel()
        self.jobs.put(None)
        self.process.join(CLOSE_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.closing.set()
        self.reader.join()
        for q in (self.jobs, self.answers):
            q.cancel_join_thread()
            q.close()


@dataclass
class Shared:
    """What the trainer and the generator process share: the weights' places and the version each holds, the lock
    both hold while a place is written or read, the job number below which jobs are dropped, the two queues."""

    places: list[dict[str, torch.Tensor]]
    versions: object  # a shared array of ints
    lock: object
    skip_below: object  # a shared int
    jobs: object  # queues
    answers: object


def serve(config, shared: Shared, spec: SamplingSpec, *, device: str, threads: int):
    """The generator process: a model built from `config` takes each job's version from its place in shared.places
    (shared.versions says which version each holds) and samples the job (`sample_job`), seeded with its seed, with
    the log-probs of what it sampled (the behaviour policy); an error is answered, not raised."""
    from transformers import AutoModelForCausalLM

    places, versions, lock, jobs, answers = shared.places, shared.versions, shared.lock, shared.jobs, shared.answers
    torch.set_num_threads(threads)
    dtype = next(iter(places[0].values())).dtype
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    loaded, idle_since = None, time.perf_counter()
    while (message := next_job(jobs)) is not None:
        number, job = message
        if number < shared.skip_below.value:
            continue
        waited = time.perf_counter() - idle_since
        try:
            with lock:
                if loaded != job.version:
                    load_weights(model, places[place_of(job, versions)])
                    loaded = job.version
            torch.manual_seed(job.seed)
            sampled = sample_job(LoopEngine(logprobs=True), model, job, spec, device)  # the behaviour log-probs too
            answer = Made(sampled.to("cpu"), job.version, waited)
        except Exception as err:  # noqa: BLE001 (answered: the trainer raises it)
            answer = portable(err)
        answers.put((number, answer))
        idle_since = time.perf_counter()


def next_job(jobs):
    """The next message of `jobs`; None (stop) also when the trainer is gone, killed or not: a process of ours
    outlives no trainer (it is a daemon, but a daemon outlives a parent killed with SIGKILL)."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    while True:
        try:
            return jobs.get(timeout=1.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return None


@torch.no_grad()
def load_weights(model, weights: dict[str, torch.Tensor]) -> None:
    """`weights` (engine_weights' names) into `model`; a tied output layer is the only key it may lack."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise GeneratorError(f"the generator's model does not take the policy's weights: {missing or unexpected}")


def portable(err: Exception) -> Exception:
    """`err` if it crosses a process boundary (pickles), else a GeneratorError with its traceback's text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001
        return GeneratorError("".join(traceback.format_exception(err)))
