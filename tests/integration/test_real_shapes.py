"""Stop tokens, pads and chat formats of four real model families, on offline stand-ins of their checkouts.

The fixtures (tests/fixtures/real_shapes.py) copy what decides how a response ends: Qwen2.5 base
(pad == eos), Qwen2.5-Instruct and Llama-3-Instruct (two stop ids in generation_config; Llama has
no pad), GPT-2 (bos == eos, no pad). Every rollout here goes through rlhf_core's own `generate`.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig

from rlhf_core.config import GRPOConfig, PPOConfig, RLConfig, RunConfig, SFTConfig
from rlhf_core.models import ModelSourceError, load_causal_lm, load_tokenizer, stop_token_ids
from rlhf_core.rl_math import INVALID_LOGPROB, response_mask
from rlhf_core.rollout import (
    SamplingSettings,
    collect_rollout,
    completion_metrics,
    decode_responses,
    left_pad,
    tokenize_prompts,
)
from tests.fixtures.real_shapes import (
    FAMILIES,
    ScriptedPolicy,
    TokenCountReward,
    build_family,
    build_without_special_tokens,
    family,
    is_chat,
    prompts_and_answers,
    render_prompt,
    sft_texts,
)

INSTRUCT = [f for f in FAMILIES if is_chat(family(f))]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run several times faster on one thread when the CPU is shared (no spinning workers)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def family_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    for name in FAMILIES:
        build_family(name, root)
    return root


def load(root, name):
    path = build_family(name, root)  # already built: reused
    return load_tokenizer(str(path)), load_causal_lm(str(path)).eval()


def ids_of(tokenizer, tokens):
    return [tokenizer.convert_tokens_to_ids(t) for t in tokens]


def one_sentence(message: str) -> bool:
    return "\n" not in message and message.strip() == message and message.replace("e.g. ", "").count(". ") == 0


RAW = {  # as the hub checkouts ship them: (tokenizer class, eos, pad, bos), before load_tokenizer borrows a pad
    "qwen2.5": ("Qwen2Tokenizer", "<|endoftext|>", "<|endoftext|>", None),
    "qwen2.5-instruct": ("Qwen2Tokenizer", "<|im_end|>", "<|endoftext|>", None),
    "llama-3-instruct": ("TokenizersBackend", "<|eot_id|>", None, "<|begin_of_text|>"),  # PreTrainedTokenizerFast in v5
    "gpt2": ("GPT2Tokenizer", "<|endoftext|>", None, "<|endoftext|>"),
}


EXPECTED = {  # (stop tokens in order, pad token after load_tokenizer, generation_config eos is a list)
    "qwen2.5": (["<|endoftext|>"], "<|endoftext|>", False),
    "qwen2.5-instruct": (["<|im_end|>", "<|endoftext|>"], "<|endoftext|>", True),
    "llama-3-instruct": (["<|end_of_text|>", "<|eot_id|>"], "<|eot_id|>", True),
    "gpt2": (["<|endoftext|>"], "<|endoftext|>", False),
}


R = 7  # response length of the scripted rollouts


def scripted_batch(tok, model, stops, min_tokens=1):
    """Five prompts of different lengths (left padding) and a script per row:
    0: first stop id at 2 | 1: last stop id at 4 | 2: no stop | 3: first stop id on the last step |
    4: last stop id at 1, then the first one at 3 (the first stop counts)."""
    prompts = [q for q, _ in prompts_and_answers()[:5]]
    prompts[1] = "Hi."
    ids, mask = left_pad(tokenize_prompts(tok, prompts, 32), tok.pad_token_id)
    word = tok.convert_tokens_to_ids("Ġcat")
    assert word not in stops and word != tok.pad_token_id
    script = torch.full((5, R), word)
    a, b = stops[0], stops[-1]
    script[0, 2], script[1, 4], script[3, R - 1], script[4, 1], script[4, 3] = a, b, a, b, a
    return ids, mask, ScriptedPolicy(model, ids.shape[1], script)


FOREIGN = {
    "qwen2.5": "<|eot_id|>",
    "qwen2.5-instruct": "<|eot_id|>",
    "llama-3-instruct": "<|im_end|>",
    "gpt2": "<|im_end|>",
}


def _rollout_stats(policy, tok, prompts, stops, response_length, seed=0):
    ids, mask = left_pad(tokenize_prompts(tok, prompts, 48), tok.pad_token_id)
    torch.manual_seed(seed)
    rollout = collect_rollout(
        policy,
        None,
        ids,
        mask,
        SamplingSettings(response_length=response_length, temperature=1.0),
        pad_token_id=tok.pad_token_id,
        stop_token_ids=stops,
        need_reference=False,
        need_logprobs=False,
    )
    ended_on = [rollout.responses[i, rollout.last_index[i]].item() for i in range(len(prompts)) if rollout.has_stop[i]]
    return completion_metrics(rollout)["completions/clipped_ratio"].item(), ended_on


CONVERSATION = [
    {"role": "user", "content": "Tell me about the cat."},
    {"role": "assistant", "content": "the cat sleeps all day."},
]


@pytest.mark.parametrize("name", FAMILIES)
def test_fixtures_have_the_families_special_token_layout(family_root, name):
    path = build_family(name, family_root)
    raw = AutoTokenizer.from_pretrained(path)
    assert (type(raw).__name__, raw.eos_token, raw.pad_token, raw.bos_token) == RAW[name]
    specials = family(name).specials
    assert ids_of(raw, specials) == list(range(len(raw) - len(specials), len(raw)))  # after the ordinary vocabulary
    model = load_causal_lm(str(path))
    assert (
        model.config.vocab_size >= len(raw)
        and type(model).__name__
        == {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}[family(name).arch]
    )
    assert (raw.chat_template is not None) == (name != "gpt2")
    if name == "llama-3-instruct":
        assert raw("hi")["input_ids"][0] == raw.bos_token_id  # the tokenizer prepends <|begin_of_text|>
    else:
        assert raw.bos_token_id not in raw("hi")["input_ids"] or raw.bos_token_id is None


@pytest.mark.parametrize("name", FAMILIES)
def test_stop_token_ids_come_from_generation_config_and_tokenizer(family_root, name):
    tok, model = load(family_root, name)
    stops, pad, is_list = EXPECTED[name]
    assert tok.pad_token == pad  # Qwen ships pad; Llama 3 and GPT-2 borrow eos (load_tokenizer)
    gen = model.generation_config
    assert isinstance(gen.eos_token_id, list) == is_list
    assert stop_token_ids(tok, gen) == tuple(ids_of(tok, stops))
    # the pad id plays no part: equal to a stop id in every one of these families once loaded
    assert tok.pad_token_id in stop_token_ids(tok, gen)
    # without a generation config the tokenizer's eos alone
    assert stop_token_ids(tok, None) == (tok.eos_token_id,)
    assert stop_token_ids(tok, gen, stop_token="none") == ()
    # a named stop, and more stops added without repeats
    extra = "<|im_end|>" if name.startswith("qwen") else stops[-1]
    assert stop_token_ids(tok, gen, stop_token=extra) == (tok.convert_tokens_to_ids(extra),)
    assert stop_token_ids(tok, gen, stop_tokens=[stops[0], extra]) == tuple(dict.fromkeys(ids_of(tok, [*stops, extra])))


def test_qwen_base_can_stop_on_im_end_too(family_root):
    """Qwen2.5 base knows the ChatML tokens although its eos is <|endoftext|>: rl.stop_tokens adds one."""
    tok, model = load(family_root, "qwen2.5")
    assert stop_token_ids(tok, model.generation_config, stop_tokens=["<|im_end|>"]) == tuple(
        ids_of(tok, ["<|endoftext|>", "<|im_end|>"])
    )


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("greedy", [True, False])
def test_rollout_ends_at_either_stop_id_and_nothing_after_it_counts(family_root, name, greedy):
    tok, model = load(family_root, name)
    stops = stop_token_ids(tok, model.generation_config)
    ids, mask, policy = scripted_batch(tok, model, stops)
    torch.manual_seed(0)
    rollout = collect_rollout(
        policy,
        None,
        ids,
        mask,
        SamplingSettings(response_length=R, temperature=1.0, greedy=greedy),
        pad_token_id=tok.pad_token_id,
        stop_token_ids=stops,
        need_reference=False,
    )
    a, b = stops[0], stops[-1]
    lengths = [3, 5, R, R, 2]
    assert rollout.resp_mask.sum(1).tolist() == lengths
    assert rollout.has_stop.tolist() == [True, True, False, True, True]
    assert rollout.last_index.tolist() == [n - 1 for n in lengths]
    # the stop token itself is the last real token of its response
    assert [rollout.responses[i, rollout.last_index[i]].item() for i in (0, 1, 3, 4)] == [a, b, a, b]
    for i, n in enumerate(lengths):
        assert (rollout.responses[i, n:] == tok.pad_token_id).all()  # padded after the stop (pad may equal eos)
        assert (rollout.logprobs[i, n:] == INVALID_LOGPROB).all()
        assert (rollout.logprobs[i, :n] < 0).all()
    # response_mask on its own agrees (it never looks at the pad id)
    again = response_mask(rollout.responses, stops)
    assert torch.equal(again[0], rollout.resp_mask) and torch.equal(again[2], rollout.has_stop)

    metrics = completion_metrics(rollout)
    assert metrics["completions/clipped_ratio"].item() == pytest.approx(1 / 5)
    assert metrics["completions/mean_length"].item() == pytest.approx(sum(lengths) / 5)
    assert metrics["completions/mean_terminated_length"].item() == pytest.approx((3 + 5 + R + 2) / 4)

    texts = decode_responses(tok, rollout.responses, rollout.resp_mask)
    assert texts[0] == " cat cat" and texts[4] == " cat" and texts[2] == " cat" * R  # stop token not in the text


@pytest.mark.parametrize("name", FAMILIES)
def test_missing_eos_penalty_only_hits_rows_without_a_stop(family_root, name):
    from rlhf_core.ppo import score_rollout

    tok, model = load(family_root, name)
    stops = stop_token_ids(tok, model.generation_config)
    ids, mask, policy = scripted_batch(tok, model, stops)
    rollout = collect_rollout(
        policy,
        None,
        ids,
        mask,
        SamplingSettings(response_length=R, greedy=True),
        pad_token_id=tok.pad_token_id,
        stop_token_ids=stops,
        need_reference=False,
        need_logprobs=False,
    )
    counter = TokenCountReward()
    scores, values = score_rollout(rollout, counter, counter, missing_eos_penalty=10.0)
    # the score is read on the stop token: prompt + response up to and including it, padding not counted
    expected = (mask.sum(1) + rollout.resp_mask.sum(1)).float() - 10.0 * (~rollout.has_stop).float()
    torch.testing.assert_close(scores, expected)
    assert scores.tolist()[2] == pytest.approx(mask[2].sum().item() + R - 10.0)  # the one row that never stopped
    assert (values * (1 - rollout.resp_mask) == 0).all()


@pytest.mark.parametrize("name", ["qwen2.5", "llama-3-instruct"])
def test_no_stop_before_min_tokens_even_when_the_model_wants_one(family_root, name):
    tok, model = load(family_root, name)
    stops = stop_token_ids(tok, model.generation_config)
    ids, mask, _ = scripted_batch(tok, model, stops)
    script = torch.full((ids.shape[0], R), stops[-1])  # a stop at every step
    rollout = collect_rollout(
        ScriptedPolicy(model, ids.shape[1], script),
        None,
        ids,
        mask,
        SamplingSettings(response_length=R, greedy=True, min_tokens=3),
        pad_token_id=tok.pad_token_id,
        stop_token_ids=stops,
        need_reference=False,
    )
    assert rollout.has_stop.all() and rollout.last_index.tolist() == [3] * ids.shape[0]
    assert not torch.isin(rollout.responses[:, :3], torch.tensor(stops)).any()


@pytest.mark.parametrize("name", FAMILIES)
def test_a_stop_token_the_tokenizer_does_not_know_is_named(family_root, name):
    tok, model = load(family_root, name)
    gen = model.generation_config
    with pytest.raises(ModelSourceError, match=r"^rl\.stop_tokens\[0\]: '" + FOREIGN[name].replace("|", r"\|")) as err:
        stop_token_ids(tok, gen, stop_tokens=[FOREIGN[name]])
    assert one_sentence(str(err.value))
    with pytest.raises(ModelSourceError, match=r"^rl\.stop_tokens\[1\]"):
        stop_token_ids(tok, gen, stop_tokens=[tok.eos_token, FOREIGN[name]])
    with pytest.raises(ModelSourceError, match=r"^rl\.stop_token: ") as err:
        stop_token_ids(tok, gen, stop_token=FOREIGN[name])
    assert one_sentence(str(err.value))


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_an_unknown_stop_token_stops_training_before_the_first_step(family_root, tmp_path, algorithm):
    from rlhf_core.grpo import function_reward, train_grpo
    from rlhf_core.ppo import train_ppo

    tok, policy = load(family_root, "llama-3-instruct")
    prompts = [q for q, _ in prompts_and_answers()]
    rl = RLConfig(algorithm=algorithm, total_steps=1, batch_size=4, response_length=4, stop_tokens=["<|im_end|>"])
    steps = []
    with pytest.raises(ModelSourceError, match=r"^rl\.stop_tokens\[0\]: '<\|im_end\|>' is not a token") as err:
        if algorithm == "ppo":
            _, ref = load(family_root, "llama-3-instruct")
            train_ppo(
                policy,
                TokenCountReward(),
                ref,
                TokenCountReward(),
                tok,
                prompts,
                rl,
                PPOConfig(),
                RunConfig(device="cpu"),
                max_prompt_length=16,
                output_dir=tmp_path / "out",
                on_step=steps.append,
                show_progress=False,
            )
        else:
            reward = function_reward("len", 1.0, lambda prompts, completions, **_: [float(len(c)) for c in completions])
            train_grpo(
                policy,
                None,
                [reward],
                tok,
                [{"prompt": p} for p in prompts],
                rl,
                GRPOConfig(num_generations=2),
                RunConfig(device="cpu"),
                max_prompt_length=16,
                output_dir=tmp_path / "out",
                on_step=steps.append,
                show_progress=False,
            )
    assert one_sentence(str(err.value))
    assert steps == [] and not list(tmp_path.glob("out/checkpoint-*"))


def test_a_tokenizer_with_neither_pad_nor_eos_fails_to_load(tmp_path):
    path = build_without_special_tokens(tmp_path)
    raw = AutoTokenizer.from_pretrained(path)
    assert raw.pad_token is None and raw.eos_token is None
    with pytest.raises(ModelSourceError, match="has no pad token and no eos token to borrow") as err:
        load_tokenizer(str(path))
    assert "\n" not in str(err.value)


def test_stop_token_eos_with_no_eos_anywhere_is_named(tmp_path):
    """A tokenizer with a pad but no eos, and a model whose configs name none: 'eos' cannot work."""
    path = build_without_special_tokens(tmp_path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.pad_token = "<|endoftext|>"  # the fixture's only special token, here a pad and nothing more
    gen = load_causal_lm(str(path)).generation_config
    assert gen.eos_token_id is None and tok.eos_token_id is None
    with pytest.raises(ModelSourceError, match=r"^rl\.stop_token is 'eos' but neither") as err:
        stop_token_ids(tok, gen)
    assert "\n" not in str(err.value)
    assert stop_token_ids(tok, gen, stop_token="none") == ()
    assert stop_token_ids(tok, gen, stop_token="<|endoftext|>") == (tok.pad_token_id,)


def test_an_unknown_stop_text_with_a_newline_is_reported_on_one_line(family_root):
    """A stop text holding a newline (here two words, no single token under any lookup) is quoted as a
    Python literal, so the one-sentence error stays on one line."""
    tok, model = load(family_root, "gpt2")
    with pytest.raises(ModelSourceError, match=r"^rl\.stop_tokens\[0\]") as err:
        stop_token_ids(tok, model.generation_config, stop_tokens=["the end\n"])
    assert "\n" not in str(err.value)


def test_a_stop_token_written_as_its_text_is_found_in_a_byte_level_vocabulary(family_root):
    """GPT-2, Qwen and Llama 3 use byte-level BPE, whose vocabulary spells a newline 'Ċ' and a leading
    space 'Ġ'. rl.stop_tokens: ["\\n"] (stop at the end of a line, a common choice for GPT-2
    completions) is one token of the tokenizer: found by encoding the text when it is not a vocabulary
    key; either spelling works."""
    tok, model = load(family_root, "gpt2")
    newline = tok.encode("\n", add_special_tokens=False)
    assert len(newline) == 1 and tok.convert_ids_to_tokens(newline) == ["Ċ"]
    assert stop_token_ids(tok, model.generation_config, stop_tokens=["Ċ"]) == (tok.eos_token_id, newline[0])
    assert stop_token_ids(tok, model.generation_config, stop_tokens=["\n"]) == (tok.eos_token_id, newline[0])


@pytest.mark.parametrize("name", FAMILIES)
def test_sft_corpus_ends_every_answer_with_the_stop_token(family_root, name):
    from rlhf_core.sft import tokenize_corpus

    tok, _ = load(family_root, name)
    stop = tok.convert_tokens_to_ids(family(name).sft_stop)
    assert stop == tok.eos_token_id  # <|im_end|> and <|eot_id|> for the instruct families
    ids, mask, labels = tokenize_corpus(tok, sft_texts(tok, family(name)), max_length=64).tensors
    last = mask.sum(1) - 1
    rows = torch.arange(ids.shape[0])
    assert (ids[rows, last] == stop).all()
    assert (labels[rows, last] == stop).all()  # trained on, although pad == eos for three of the families


@pytest.mark.parametrize("name", FAMILIES)
def test_sft_corpus_puts_the_stop_right_after_the_answer(family_root, name):
    """tokenize_corpus puts eos right after the text, as TRL does (and not again when the text already
    ends with it). With a byte-level BPE (every family here) a space before it would be a token of its
    own ('Ġ'), and SFT would teach a chat model "content Ġ<|im_end|>" instead of "content<|im_end|>"."""
    from rlhf_core.sft import tokenize_corpus

    tok, _ = load(family_root, name)
    texts = sft_texts(tok, family(name))
    ids, mask, _ = tokenize_corpus(tok, texts, max_length=64).tensors
    for row, text in enumerate(texts):
        real = ids[row, mask[row].bool()].tolist()
        assert real[:-1] == tok(text)["input_ids"], f"{tok.convert_ids_to_tokens(real[-3:])} closes {text!r}"


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_sft_warm_start_then_ppo_and_grpo_responses_stop(family_root, tmp_path, name):
    from rlhf_core.grpo import function_reward, train_grpo
    from rlhf_core.ppo import train_ppo
    from rlhf_core.reward_model import load_reward_model
    from rlhf_core.sft import train_sft

    spec = family(name)
    tok, base = load(family_root, name)
    stops = stop_token_ids(tok, base.generation_config)
    prompts = [render_prompt(tok, spec, q) for q, _ in prompts_and_answers()]
    length = 16  # the longest answer is 12 tokens with its stop
    # the untrained model almost never stops: the metric below is not trivially 0
    clipped_before, _ = _rollout_stats(base, tok, prompts, stops, length)
    assert clipped_before > 0.5

    sft_dir = tmp_path / "sft"
    sft = train_sft(
        base,
        tok,
        sft_texts(tok, spec),
        SFTConfig(max_steps=100, batch_size=12, learning_rate=3e-3, lr_scheduler="constant", log_steps=100),
        RunConfig(device="cpu", seed=1),
        max_length=64,
        output_dir=sft_dir,
        show_progress=False,
    )
    assert sft["sft/loss"] < 0.5
    warm = load_causal_lm(str(sft_dir)).eval()
    assert warm.generation_config.eos_token_id == base.generation_config.eos_token_id  # both stop ids survive the save
    clipped_after, ended_on = _rollout_stats(warm, tok, prompts, stops, length)
    assert clipped_after < 0.5
    # the instruct families stop on their turn end (<|im_end|> / <|eot_id|>), which is not generation_config's first
    # id for Llama 3: a loop that honoured one id only would clip every response
    sft_stop = tok.convert_tokens_to_ids(spec.sft_stop)
    assert ended_on.count(sft_stop) >= len(ended_on) - 1

    rl = dict(
        total_steps=2,
        batch_size=8,
        learning_rate=1e-5,
        response_length=length,
        temperature=1.0,
        save_steps=100,
        log_steps=1,
    )
    ppo_logs = []
    result = train_ppo(
        load_causal_lm(str(sft_dir)),
        load_reward_model(str(sft_dir), tok, seed=0),
        load_causal_lm(str(sft_dir)),
        load_reward_model(str(sft_dir), tok, seed=1),
        tok,
        prompts,
        RLConfig(**rl),
        PPOConfig(num_ppo_epochs=1),
        RunConfig(device="cpu", seed=3),
        max_prompt_length=48,
        output_dir=tmp_path / "ppo",
        on_log=lambda m, s: ppo_logs.append(m),
        show_progress=False,
    )
    assert len(ppo_logs) == 2
    for logged in ppo_logs:
        assert logged["completions/clipped_ratio"] < 0.5, logged
        assert 0 < logged["completions/mean_terminated_length"] <= length
        assert logged["val/num_eos_tokens"] >= 4
    saved = load_causal_lm(str(result.checkpoint / "policy"))
    assert saved.generation_config.eos_token_id == base.generation_config.eos_token_id

    grpo_logs = []
    has_a = function_reward("has_a", 1.0, lambda prompts, completions, **_: [float("a" in c) for c in completions])
    train_grpo(
        load_causal_lm(str(sft_dir)),
        None,
        [has_a],
        tok,
        [{"prompt": p} for p in prompts],
        RLConfig(algorithm="grpo", **rl),
        GRPOConfig(num_generations=4),
        RunConfig(device="cpu", seed=3),
        max_prompt_length=48,
        output_dir=tmp_path / "grpo",
        on_log=lambda m, s: grpo_logs.append(m),
        show_progress=False,
    )
    assert len(grpo_logs) == 2
    for logged in grpo_logs:
        assert logged["completions/clipped_ratio"] < 0.5, logged
        assert 0 < logged["completions/mean_terminated_length"] <= length


def test_qwen_instruct_chat_template_renders_chatml_ending_with_im_end(family_root):
    tok, _ = load(family_root, "qwen2.5-instruct")
    text = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nTell me about the cat.<|im_end|>\n"
        "<|im_start|>assistant\nthe cat sleeps all day.<|im_end|>\n"
    )
    assert text.rstrip("\n").endswith("<|im_end|>")
    ids = tok(text)["input_ids"]
    im_end, im_start = ids_of(tok, ["<|im_end|>", "<|im_start|>"])
    assert ids[-2] == im_end and tok.convert_ids_to_tokens(ids[-1]) == "Ċ"  # one token each, then the newline
    assert ids.count(im_start) == ids.count(im_end) == 3
    assert stop_token_ids(tok, load_causal_lm(str(family_root / "qwen2.5-instruct")).generation_config)[0] == im_end
    prompt = tok.apply_chat_template(CONVERSATION[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n") and text.startswith(prompt)


def test_llama_3_instruct_chat_template_ends_turns_with_eot_id(family_root):
    tok, _ = load(family_root, "llama-3-instruct")
    text = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert text.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n")
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\nthe cat sleeps all day.<|eot_id|>")
    # what the pipeline tokenizes: the prompt without the template's bos, since the tokenizer adds one
    prompt = render_prompt(tok, family("llama-3-instruct"), "Tell me about the cat.")
    ids = tok(prompt)["input_ids"]
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id


@pytest.mark.parametrize("name", INSTRUCT)
def test_exported_generation_config_keeps_every_stop_id(family_root, name):
    """The exported generation_config keeps every id the run stopped on (both ids of an instruct model,
    and rl.stop_tokens), so transformers' generate, and a later RL run from the export, stop as the
    trained policy learned to; not the tokenizer's eos alone."""
    from rlhf_core.export import generation_settings

    tok, model = load(family_root, name)
    stops = stop_token_ids(tok, model.generation_config)
    base = model.generation_config.to_diff_dict()
    settings = generation_settings(tokenizer=tok, max_new_tokens=8, stop_token_ids=stops, base_defaults=base)
    exported = GenerationConfig(**settings)
    assert len(stops) == 2 and set(stop_token_ids(tok, exported)) == set(stops)
    # the base's own inference defaults, not RL's sampling settings
    for key in ("do_sample", "temperature", "top_p", "top_k"):
        assert getattr(exported, key) == getattr(model.generation_config, key)


END_OF_TURN = {"qwen2.5": "<|im_end|>", "qwen2.5-instruct": "<|im_end|>", "llama-3-instruct": "<|eot_id|>"}


@pytest.mark.parametrize("name", FAMILIES)
def test_conversational_reward_pairs_end_on_the_token_a_rollout_stops_on(family_root, tmp_path, name):
    """A conversational preference pair, read as the data stage reads it and tokenized for the reward model
    with the family's stop ids, ends where a rollout that stops ends: on the end-of-turn token when it is a
    stop id (Qwen2.5-Instruct, Llama-3-Instruct; no template newline after it, no eos added), else on the
    eos appended right after it (Qwen2.5 base, whose generation_config stops on <|endoftext|> only; GPT-2,
    which has no template and borrows eos as pad, with model.chat_template supplying ChatML)."""
    import json

    from rlhf_core.config import DatasetSpec
    from rlhf_core.data import load_table
    from rlhf_core.models import generation_config_of
    from rlhf_core.reward_model import tokenize_pairs
    from tests.fixtures.real_shapes import CHATML_TEMPLATE

    path = str(build_family(name, family_root))
    tok = load_tokenizer(path, chat_template=CHATML_TEMPLATE)  # a template only where the family has none
    stops = stop_token_ids(tok, generation_config_of(path))
    user = [{"role": "user", "content": "Tell me about the cat."}]
    row = {
        "prompt": user,
        "chosen": [{"role": "assistant", "content": "the cat sleeps."}],
        "rejected": [{"role": "assistant", "content": "no."}],
    }
    data = tmp_path / "prefs.jsonl"
    data.write_text(json.dumps(row) + "\n")
    table = load_table(DatasetSpec(path=str(data)), "preference", field="data.preference", tokenizer=tok)
    (item,) = tokenize_pairs(tok, table.to_list(), 256, stops)
    end = tok.convert_tokens_to_ids(END_OF_TURN[name]) if name in END_OF_TURN else None
    for seq in (item["chosen"], item["rejected"]):
        assert seq[-1] in stops  # the reward model is trained where RL reads it
        if end in stops:
            assert seq[-1] == end and seq.count(tok.eos_token_id) <= seq.count(end)
        else:
            assert seq[-1] == tok.eos_token_id
            if end is not None:
                assert seq[-2] == end  # eos right after the turn's end: the template's newline is dropped
        if tok.bos_token_id is not None and tok.bos_token_id != tok.eos_token_id:
            assert seq.count(tok.bos_token_id) <= 1  # a template that writes bos gets no second one


@pytest.mark.parametrize("name", FAMILIES)
def test_the_decode_loops_ready_sdpa_mask_samples_what_the_models_own_mask_samples(family_root, name, monkeypatch):
    # the rollout hands SDPA models a ready 4-D boolean mask instead of the 2-D one: on every family's layout
    # (pad == eos, two stop ids, no pad with bos, GPT-2's learned positions) the samples must not change
    import rlhf_core.rollout as rollout

    tok, model = load(family_root, name)
    spec = family(name)
    assert rollout._takes_ready_sdpa_mask(model)  # the path under test is the one these models take
    questions = [q for q, _ in prompts_and_answers()[:3]] + ["Hi."]
    prompts = [render_prompt(tok, spec, q) for q in questions]
    ids, mask = left_pad(tokenize_prompts(tok, prompts, 32), tok.pad_token_id)
    ids, mask = ids.repeat_interleave(2, dim=0), mask.repeat_interleave(2, dim=0)  # GRPO's groups share a prompt
    stops = stop_token_ids(tok, model.generation_config)
    settings = SamplingSettings(response_length=R, temperature=1.3, min_tokens=2)

    def sample():
        torch.manual_seed(5)
        return rollout.generate(
            model, ids, mask, settings, pad_token_id=tok.pad_token_id, stop_token_ids=stops, prompt_repeats=2
        )

    ready = sample()
    monkeypatch.setattr(rollout, "_takes_ready_sdpa_mask", lambda model: False)
    assert torch.equal(ready, sample())
