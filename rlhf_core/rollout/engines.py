"""The rollout engines behind `collect.sample`, picked by rollout.engine: `LoopEngine` (hf, our decode loop in the
trainer's process) and `VllmEngine` (a vLLM server apart, `vllm_server.py`), with what the second needs around it:
the server for the stage's length (`vllm_server`), the policy's weights pushed to it (`engine_weights`), seeded
requests, and the completions turned back into the padded tensors our loop makes.

An engine's `generate` returns the responses, (B, response_length) right-padded with the pad id after the stop token
exactly as `generation.generate` pads them, and the engine's own log-probs of the sampled tokens where it has them
(the behaviour policy of `rl/engine_correction.py`). `sync(policy, step)` runs on every process at the start of a
step's rollout: vLLM's main process pushes the weights when due and the others wait for it; `refresh` pushes them
whatever the cadence (before an evaluation on the engine).
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from rlhf_core.config import RolloutConfig
from rlhf_core.rl_math import INVALID_LOGPROB
from rlhf_core.rollout.generation import generate
from rlhf_core.rollout.sampling import SamplingSettings
from rlhf_core.rollout.vllm_server import Completion, ServerSettings, VllmClient, VllmError, VllmServer

WEIGHTS_FILE = "model.safetensors"
MAX_CONCURRENT_REQUESTS = 64


class Generated(NamedTuple):
    responses: torch.Tensor  # (B, R) right-padded with the pad id after the stop token
    behaviour_logprobs: torch.Tensor | None  # (B, R) the engine's log-probs of the sampled tokens; None: it has none


class RolloutEngine(Protocol):
    name: str

    def generate(
        self,
        policy,
        query_ids: torch.Tensor,
        query_mask: torch.Tensor,
        settings: SamplingSettings,
        *,
        pad_token_id: int,
        stop_token_ids: Sequence[int],
        prompt_repeats: int = 1,
        seed: int | None = None,
    ) -> Generated: ...

    def sync(self, policy, step: int) -> None: ...

    def refresh(self, policy, step: int) -> None: ...


class LoopEngine:
    """rollout.engine hf: `generation.generate` on the policy itself; the torch generator seeds it (`seed` unused).
    With `logprobs` (a generator apart, `ahead.py`) it returns the sampled tokens' log-probs too; else None: the
    policy that samples is the one that trains."""

    name = "hf"

    def __init__(self, logprobs: bool = False):
        self.logprobs = logprobs

    def generate(
        self, policy, query_ids, query_mask, settings, *, pad_token_id, stop_token_ids, prompt_repeats=1, seed=None
    ):
        extra = {"with_logprobs": True} if self.logprobs else {}
        made = generate(
            policy,
            query_ids,
            query_mask,
            settings,
            pad_token_id=pad_token_id,
            stop_token_ids=stop_token_ids,
            prompt_repeats=prompt_repeats,
            **extra,
        )
        return Generated(*made) if self.logprobs else Generated(made, None)

    def sync(self, policy, step: int) -> None:
        pass

    def refresh(self, policy, step: int) -> None:
        pass


def rollout_seed(seed: int, *, rank: int, step: int, call: int = 0) -> int:
    """The base seed of one generation call: a function of the run's seed, the process, the RL step and the call
    within the step (dynamic sampling's rounds), so a resumed run sends the requests an uninterrupted one sent."""
    digest = hashlib.sha256(f"{seed}/{rank}/{step}/{call}".encode()).digest()
    return int.from_bytes(digest[:4], "little") >> 2  # below 2**30: room for seed + row offsets in vLLM's int


def prompt_lists(query_ids: torch.Tensor, query_mask: torch.Tensor) -> list[list[int]]:
    """Each left-padded row's prompt ids, the padding dropped."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(query_ids.cpu(), query_mask.cpu())]


def grouped(prompts: list[list[int]], repeats: int) -> bool:
    """The rows come in runs of `repeats` copies of one prompt (GRPO's groups)."""
    if repeats <= 1 or len(prompts) % repeats:
        return False
    return all(prompts[i] == prompts[i - i % repeats] for i in range(len(prompts)))


def completions_to_tensors(
    completions: Sequence[Completion], width: int, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(responses, log-probs), each (B, width): the sampled ids then the pad id, the engine's log-probs then
    INVALID_LOGPROB (the pad's, as the trainer's rollout writes them)."""
    responses = torch.full((len(completions), width), pad_token_id, dtype=torch.long)
    logprobs = torch.full((len(completions), width), INVALID_LOGPROB, dtype=torch.float32)
    for i, c in enumerate(completions):
        if len(c.token_ids) > width:
            raise VllmError(f"the vLLM server sampled {len(c.token_ids)} tokens where at most {width} were asked for")
        responses[i, : len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long)
        logprobs[i, : len(c.logprobs)] = torch.tensor(c.logprobs, dtype=torch.float32)
    return responses, logprobs


@torch.no_grad()
def engine_weights(model) -> dict[str, torch.Tensor]:
    """The policy's weights under the names of the model the server loaded: a PEFT policy with its LoRA merged
    (base + delta, the policy itself untouched) and its wrappers' names removed; a tied output layer left out."""
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    deltas = {}
    if base is not model:
        from peft.tuners.lora import LoraLayer

        for name, module in base.named_modules():
            if isinstance(module, LoraLayer):
                active = [a for a in module.active_adapters if a in module.lora_A]
                deltas[name] = sum(module.get_delta_weight(a) for a in active) if active else None
    state = {}
    for key, value in base.state_dict().items():
        if ".lora_" in key or ".original_module." in key:
            continue
        owner = key.rsplit(".", 2)[0] if ".base_layer." in key else None
        if owner is not None and key.endswith(".base_layer.weight") and deltas.get(owner) is not None:
            value = value + deltas[owner].to(value.dtype)
        name = key.replace(".base_layer.", ".")
        if ".modules_to_save." in name:  # peft's trained copy of a whole module: `x.modules_to_save.<adapter>.w`
            head, tail = name.split(".modules_to_save.", 1)
            name = f"{head}.{tail.split('.', 1)[1]}"
        state[name] = value.detach().to("cpu").contiguous()
    if getattr(getattr(base, "config", None), "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def write_engine_weights(model, directory: Path) -> Path:
    """`engine_weights(model)` as `directory`/model.safetensors, replaced whole (a reader never sees half a file)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / (WEIGHTS_FILE + ".partial")
    save_file(engine_weights(model), str(partial), metadata={"format": "pt"})
    os.replace(partial, directory / WEIGHTS_FILE)
    return directory


class VllmEngine:
    """rollout.engine vllm: requests to one server, one per prompt (with n = the group's size), seeded from the
    call's base seed; the engine's log-probs come back with the tokens. `sync` pushes the policy every
    `sync_every` steps (and at the first step this process runs, a resumed run's included) from the main process,
    and `barrier` makes the others wait for it."""

    name = "vllm"

    def __init__(
        self,
        client: VllmClient,
        weights_dir: Path | None,
        *,
        sync_every: int = 1,
        pushes: bool = True,
        barrier: Callable[[], None] | None = None,
    ):
        self.client, self.weights_dir, self.sync_every = client, weights_dir, sync_every
        self.pushes, self.barrier = pushes, barrier
        self.pushed_at: int | None = None

    def generate(
        self, policy, query_ids, query_mask, settings, *, pad_token_id, stop_token_ids, prompt_repeats=1, seed=None
    ):
        prompts = prompt_lists(query_ids, query_mask)
        n = prompt_repeats if grouped(prompts, prompt_repeats) else 1
        unique = prompts[::n]
        base = 0 if seed is None else seed

        def request(i: int) -> list[Completion]:
            # vLLM seeds the n samples of one request seed, seed + 1, ...: requests are n apart
            return self.client.complete([unique[i]], settings, stop_token_ids, n=n, seed=base + i * n)

        workers = max(1, min(MAX_CONCURRENT_REQUESTS, len(unique)))
        with ThreadPoolExecutor(workers, thread_name_prefix="vllm-request") as pool:
            completions = [c for answer in pool.map(request, range(len(unique))) for c in answer]
        responses, logprobs = completions_to_tensors(completions, settings.response_length, pad_token_id)
        return Generated(responses.to(query_ids.device), logprobs.to(query_ids.device))

    def sync(self, policy, step: int) -> None:
        if self.pushed_at is not None and step - self.pushed_at < self.sync_every:
            return
        if self.pushes:
            self.stage(policy)
            self.load_staged()
        if self.barrier is not None:
            self.barrier()
        self.pushed_at = step

    def stage(self, policy, slot: int | None = None) -> None:
        """The policy's weights written where the server reads them (`load_staged` has it read them): the weights
        directory, or its place `slot` (`slot-N/`) when generation runs ahead (`ahead.py`)."""
        write_engine_weights(policy, self._place(slot))

    def load_staged(self, slot: int | None = None) -> None:
        self.client.load_weights(self._place(slot))

    def _place(self, slot: int | None) -> Path:
        return self.weights_dir if slot is None else self.weights_dir / f"slot-{slot}"

    def refresh(self, policy, step: int) -> None:
        """The policy on the server now, whatever the cadence (an evaluation's samples); the rollout of `step` then
        needs no push of its own."""
        self.pushed_at = None
        self.sync(policy, step)


def model_name_at(url: str, timeout_s: float = 10.0) -> str:
    """The name the server at `url` serves its model under (the first of GET /v1/models)."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/v1/models", timeout=timeout_s) as response:
            models = json.loads(response.read())["data"]
    except (OSError, ValueError, KeyError) as err:
        raise VllmError(f"rollout.vllm.url {url} did not list its model at /v1/models: {err}") from None
    if not models:
        raise VllmError(f"rollout.vllm.url {url} serves no model")
    return models[0]["id"]


@contextmanager
def vllm_server(
    rollout: RolloutConfig,
    model_dir: Path,
    *,
    max_model_len: int,
    seed: int,
    trust_remote_code: bool = False,
    log_path: Path | None = None,
) -> Iterator[str | None]:
    """The vLLM server's URL for the length of the block: rollout.vllm.url as it is, else a server started from
    `model_dir` (the policy at the stage's start) and stopped when the block ends, however it ends; None for hf."""
    if rollout.engine != "vllm":
        yield None
        return
    v = rollout.vllm
    if v.url is not None:
        yield v.url
        return
    settings = ServerSettings(
        python=v.interpreter(),
        model=Path(model_dir),
        max_model_len=max_model_len,
        port=v.port,
        host=v.host,
        seed=seed,
        startup_timeout_s=v.startup_timeout_s,
        kv_cache_gib=v.kv_cache_gib,
        dtype=v.dtype,
        trust_remote_code=trust_remote_code,
        log_path=log_path,
    )
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with VllmServer(settings) as server:
        yield server.url


def make_engine(rollout: RolloutConfig, weights_dir: Path, loop) -> RolloutEngine:
    """The engine of rollout.engine for a training loop's process: for vllm, a client of the server at
    rollout.vllm.url whose main process pushes weights into `weights_dir`."""
    if rollout.engine != "vllm":
        return LoopEngine()
    url = rollout.vllm.url
    if url is None:
        raise VllmError("rollout.engine vllm needs a server: rollout.vllm.url, or the RL stage starting one")
    barrier = loop.accelerator.wait_for_everyone if loop.world > 1 else None
    return VllmEngine(
        VllmClient(url, model_name_at(url)),
        weights_dir,
        sync_every=rollout.vllm.sync_every_steps,
        pushes=loop.is_main,
        barrier=barrier,
    )
