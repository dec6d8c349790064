"""rlhf_core/rewards/reward_model.py: Bradley-Terry reward-model training, evaluation, LoRA and resume."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from rlhf_core.config import LoraSettings, RewardConfig, RunConfig
from rlhf_core.demo.world import world_rows
from rlhf_core.models.card import read_front_matter
from rlhf_core.models.loading import load_tokenizer
from rlhf_core.rewards.reward_model import (
    EVAL_METRICS,
    PreferencePairs,
    bradley_terry_loss,
    collate_pairs,
    evaluate_reward_model,
    load_reward_model,
    preference_metrics,
    score_pairs,
    tokenize_pairs,
    train_reward_model,
)
from rlhf_core.training.loop import Hooks

CARD = {
    "title": "test reward model",
    "metadata": {"base_model": "tiny", "datasets": ["demo"], "tags": ["rlhf"]},
    "body": "trained in a test",
}


def encode_pairs(tokenizer, rows, max_length):
    """Rows straight to a model batch, as the training loop builds them."""
    return collate_pairs(tokenize_pairs(tokenizer, rows, max_length), tokenizer.pad_token_id)


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def short_run(smoke_world, out, *, lora=None, max_steps=6, on_log=None, **cfg):
    tokenizer = load_tokenizer(str(smoke_world.tokenizer))
    model = load_reward_model(str(smoke_world.base_model), tokenizer, lora=lora, seed=1)
    settings = RewardConfig(
        max_steps=max_steps, batch_size=8, learning_rate=5e-3, eval_steps=3, save_steps=2, log_steps=1, **cfg
    )
    events = {"log": [], "eval": [], "ckpt": []}

    def log(metrics, step):
        events["log"].append(step)
        if on_log is not None:
            on_log(metrics, step)

    pairs = PreferencePairs(
        world_rows(smoke_world, "preference", "train"), world_rows(smoke_world, "preference", "test"), max_length=40
    )
    hooks = Hooks(
        on_log=log,
        on_eval=lambda m, s: events["eval"].append((s, m)),
        on_checkpoint=lambda p, s: events["ckpt"].append(s),
        show_progress=False,
    )
    result = train_reward_model(
        model, tokenizer, pairs, settings, RunConfig(device="cpu", seed=3), output_dir=out, card=CARD, hooks=hooks
    )
    return model, tokenizer, result, events


def test_bradley_terry_loss_by_hand():
    rc, rr = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    # pair 1: diff 1, pair 2: diff -1
    expected = -(math.log(sigmoid(1.0)) + math.log(sigmoid(-1.0))) / 2
    assert bradley_terry_loss(rc, rr).item() == pytest.approx(expected, rel=1e-6)
    # with margins 0.5 and -1: diffs 0.5 and 0.0
    expected_m = -(math.log(sigmoid(0.5)) + math.log(sigmoid(0.0))) / 2
    assert bradley_terry_loss(rc, rr, torch.tensor([0.5, -1.0])).item() == pytest.approx(expected_m, rel=1e-6)
    # centering adds coef * mean((rc + rr)^2) = 0.01 * (9 + 1) / 2
    assert bradley_terry_loss(rc, rr, center_rewards_coefficient=0.01).item() == pytest.approx(
        expected + 0.05, rel=1e-6
    )
    assert bradley_terry_loss(torch.tensor([0.0]), torch.tensor([0.0])).item() == pytest.approx(math.log(2), rel=1e-6)


def test_preference_metrics_by_hand():
    m = preference_metrics(torch.tensor([2.0, 0.0, 1.0, -1.0]), torch.tensor([1.0, 1.0, 1.0, -3.0]))
    assert m["accuracy"] == 0.5  # a tie does not count as correct
    assert m["margin"] == pytest.approx((1 - 1 + 0 + 2) / 4)
    assert (m["min_reward"], m["max_reward"]) == (-3.0, 2.0)
    assert m["mean_reward"] == pytest.approx(sum([2, 0, 1, -1, 1, 1, 1, -3]) / 8)


def test_chosen_and_rejected_share_one_forward(smoke_world):
    tokenizer = load_tokenizer(str(smoke_world.tokenizer))
    rows = [
        {"prompt": "the food was", "chosen": " great .", "rejected": " awful and the room was dirty .", "margin": 1.0},
        {"prompt": "the room was", "chosen": " lovely .", "rejected": " bad ."},
    ]
    batch = encode_pairs(tokenizer, rows, max_length=32)
    assert batch["input_ids"].shape[0] == 4 and batch["margin"].tolist() == [1.0, 0.0]
    model = load_reward_model(str(smoke_world.base_model), tokenizer)
    calls = []
    model.model.register_forward_hook(lambda mod, args, out: calls.append(1))  # the backbone
    rc, rr = score_pairs(model, batch)
    assert len(calls) == 1 and rc.shape == rr.shape == (2,)
    # every sequence ends with eos, and right padding does not change its score (read at the last real token)
    ids = tokenizer("the food was great .").input_ids + [tokenizer.eos_token_id]
    assert batch["input_ids"][0, : len(ids)].tolist() == ids and batch["attention_mask"][0].sum() == len(ids)
    # alone, read at its last token (the classifier's own pooling, told of no pad: with pad == eos it
    # would pool before the closing eos)
    model.config.pad_token_id = None
    alone = model(input_ids=torch.tensor([ids])).logits.squeeze()
    torch.testing.assert_close(rc[0], alone, atol=1e-5, rtol=1e-5)
    long = encode_pairs(tokenizer, [{"prompt": "a " * 50, "chosen": "b", "rejected": "c"}], max_length=8)
    assert long["input_ids"].shape[1] == 8 and long["input_ids"][0, -1] == tokenizer.eos_token_id


def test_short_run_trains_every_parameter_evaluates_and_checkpoints(tmp_path, smoke_world):
    tokenizer = load_tokenizer(str(smoke_world.tokenizer))
    before = {
        n: p.detach().clone()
        for n, p in load_reward_model(str(smoke_world.base_model), tokenizer, seed=1).named_parameters()
    }
    model, tokenizer, result, events = short_run(smoke_world, tmp_path / "rm")
    for name, param in model.named_parameters():
        assert not torch.equal(before[name], param.detach()), f"{name} did not change"
    assert [s for s, _ in events["eval"]] == [3, 6] and events["ckpt"] == [2, 4, 6]
    assert set(events["eval"][-1][1]) == set(EVAL_METRICS)
    assert result.step == 6 and result.checkpoint == tmp_path / "rm" / "checkpoint-6"

    # the checkpoint is a plain HF directory that scores as the trained model does
    loaded = AutoModelForSequenceClassification.from_pretrained(result.checkpoint)
    batch = encode_pairs(tokenizer, world_rows(smoke_world, "preference", "test")[:4], 40)
    with torch.no_grad():
        model.eval()
        torch.testing.assert_close(score_pairs(loaded, batch), score_pairs(model, batch))
    card = read_front_matter(result.checkpoint / "README.md")
    assert card["base_model"] == "tiny" and card["eval_metrics"]["eval_accuracy"] == result.metrics["eval_accuracy"]
    assert not list(result.checkpoint.rglob("*.bin")) and not list(result.checkpoint.rglob("*.pt"))


def test_lora_trains_adapters_and_score_head_only(tmp_path, smoke_world):
    tokenizer = load_tokenizer(str(smoke_world.tokenizer))
    lora = LoraSettings(enabled=True, r=4, alpha=8, dropout=0.0)
    reference = load_reward_model(str(smoke_world.base_model), tokenizer, lora=lora, seed=1)
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    model, _, result, _ = short_run(smoke_world, tmp_path / "rm", lora=lora, max_steps=4)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("lora_" in n for n in trainable) and any("score" in n for n in trainable)
    for name, param in model.named_parameters():
        changed = not torch.equal(before[name], param.detach())
        assert changed == (name in trainable), f"{name}: trainable={name in trainable} changed={changed}"
    assert (result.checkpoint / "adapter" / "adapter_config.json").is_file()
    merged = AutoModelForSequenceClassification.from_pretrained(result.checkpoint)
    batch = encode_pairs(tokenizer, world_rows(smoke_world, "preference", "test")[:4], 40)
    with torch.no_grad():
        model.eval()
        torch.testing.assert_close(score_pairs(merged, batch), score_pairs(model, batch), atol=1e-5, rtol=1e-4)


def test_resume_after_a_crash_reaches_the_same_weights(tmp_path, smoke_world):
    # given an uninterrupted run
    straight, tokenizer, full, _ = short_run(smoke_world, tmp_path / "straight")

    # when a run crashes at step 5 (after checkpoint-4) and is started again
    def crash(metrics, step):
        if step == 5:
            raise RuntimeError("injected crash")

    with pytest.raises(RuntimeError, match="injected crash"):
        short_run(smoke_world, tmp_path / "crashed", on_log=crash)
    resumed, _, result, events = short_run(smoke_world, tmp_path / "crashed")

    # then it continues from step 4, saves only what was missing, and matches the uninterrupted run
    assert result.resumed_from == 4 and result.step == 6
    assert events["log"] == [5, 6] and events["ckpt"] == [6]
    for (name, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{name} differs after resume")
    assert result.metrics == full.metrics

    # and a third start finds nothing left to do
    _, _, again, events = short_run(smoke_world, tmp_path / "crashed")
    assert again.resumed_from == 6 and events == {"log": [], "eval": [], "ckpt": []}
    assert again.metrics == full.metrics


def test_evaluate_reward_model_counts_all_rows(smoke_world):
    tokenizer = load_tokenizer(str(smoke_world.tokenizer))
    model = load_reward_model(str(smoke_world.base_model), tokenizer, seed=1)
    rows = world_rows(smoke_world, "preference", "test")
    a = evaluate_reward_model(model, tokenizer, rows, max_length=40, batch_size=3)
    b = evaluate_reward_model(model, tokenizer, rows, max_length=40, batch_size=len(rows))
    assert a == pytest.approx(b, rel=1e-5)


@pytest.mark.parametrize("disable", [True, False])
def test_reward_training_turns_dropout_off_unless_asked(tmp_path, smoke_world, disable):
    model, _, _, _ = short_run(
        smoke_world,
        tmp_path / "rm",
        lora=LoraSettings(enabled=True, r=4, alpha=8, dropout=0.5),
        max_steps=1,
        disable_dropout=disable,
    )
    rates = {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}
    assert rates == ({0.0} if disable else {0.5})


@pytest.mark.parametrize("name", ["qwen2.5", "gpt2"])
def test_pairs_are_scored_on_their_closing_eos_when_pad_is_eos(tmp_path, name):
    """With pad == eos the classifier's own forward pools at the last non-pad token, the one before
    the eos; ours reads the eos itself, where RL's sequence_scores reads a response's stop token."""
    from rlhf_core.models.forward import head_per_token, sequence_scores
    from tests.fixtures.real_shapes import build_family

    path = build_family(name, tmp_path)
    tokenizer = load_tokenizer(str(path))
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    model = load_reward_model(str(path), tokenizer, seed=0).eval()
    rows = [{"prompt": "the food was", "chosen": " great", "rejected": " not good at all"}]
    batch = encode_pairs(tokenizer, rows, max_length=32)
    with torch.no_grad():
        rc, rr = score_pairs(model, batch)
        per_token = head_per_token(model, batch["input_ids"], batch["attention_mask"])
        last = batch["attention_mask"].sum(1) - 1
        assert batch["input_ids"][0, last[0]] == tokenizer.eos_token_id
        torch.testing.assert_close(torch.stack([rc[0], rr[0]]), per_token[torch.arange(2), last])
        hf_pooled = model(**batch).logits.squeeze(-1)
        torch.testing.assert_close(hf_pooled[0], per_token[0, last[0] - 1])  # what the pad search reads
        # the chosen text as an RL query + response that stopped on eos: the same score
        prompt = tokenizer("the food was")["input_ids"]
        response = batch["input_ids"][0, len(prompt) : last[0] + 1]
        score = sequence_scores(
            model,
            torch.tensor([prompt]),
            torch.ones(1, len(prompt), dtype=torch.long),
            response[None],
            torch.ones_like(response)[None],
            torch.tensor([len(response) - 1]),
        )
        torch.testing.assert_close(score[0], rc[0])


def test_templated_pairs_get_one_bos(tmp_path):
    from rlhf_core.data.chat import render_completions
    from rlhf_core.models.loading import load_tokenizer as load_tok
    from rlhf_core.rewards.reward_model import tokenize_pairs
    from tests.fixtures.real_shapes import build_family

    tok = load_tok(str(build_family("llama-3-instruct", tmp_path)))
    user = [{"role": "user", "content": "Hi"}]
    prompt, (chosen, rejected) = render_completions(
        tok, user, [[{"role": "assistant", "content": "Hello"}], [{"role": "assistant", "content": "Bye"}]]
    )
    (item,) = tokenize_pairs(tok, [{"prompt": prompt, "chosen": chosen, "rejected": rejected}], max_length=64)
    assert item["chosen"] == tok(prompt + chosen, add_special_tokens=False)["input_ids"]
    assert item["chosen"].count(tok.bos_token_id) == 1 and item["chosen"][-1] == tok.eos_token_id


def test_conversational_pairs_end_where_rl_stops(tmp_path):
    """Qwen2.5 base with its ChatML template: eos (== pad) is <|endoftext|>, turns end with <|im_end|>.
    With the run's stop ids the pair ends at <|im_end|>, the token RL reads the score at; without them
    eos is appended (TRL's rule), and a standard pair always gets eos."""
    from rlhf_core.data.chat import end_at_turn_end, render_completions
    from rlhf_core.models.loading import load_tokenizer as load_tok
    from rlhf_core.rewards.reward_model import tokenize_pairs
    from tests.fixtures.real_shapes import CHATML_TEMPLATE, build_family

    tok = load_tok(str(build_family("qwen2.5", tmp_path)), chat_template=CHATML_TEMPLATE)
    assert tok.pad_token_id == tok.eos_token_id
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    user = [{"role": "user", "content": "Hi"}]
    prompt, completions = render_completions(
        tok, user, [[{"role": "assistant", "content": "Hello"}], [{"role": "assistant", "content": "Bye"}]]
    )
    row = {"prompt": prompt, "chosen": end_at_turn_end(completions[0]), "rejected": end_at_turn_end(completions[1])}
    (item,) = tokenize_pairs(tok, [row], max_length=64, stop_ids=(im_end, tok.eos_token_id))
    assert item["chosen"][-1] == im_end and item["rejected"][-1] == im_end
    assert item["chosen"] == tok(prompt + row["chosen"], add_special_tokens=False)["input_ids"]
    (without,) = tokenize_pairs(tok, [row], max_length=64)
    assert without["chosen"] == item["chosen"] + [tok.eos_token_id]
    (plain,) = tokenize_pairs(tok, [{"prompt": "a", "chosen": " b", "rejected": " c"}], 64, (im_end,))
    assert plain["chosen"][-1] == tok.eos_token_id


def test_length_correlation_and_bias_by_hand():
    from rlhf_core.rewards.reward_model import length_bias, length_correlation, pearson

    x, y = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0, 7.0])
    # centred: (-1, 0, 1) and (-7/3, -1/3, 8/3): r = (7/3 + 8/3) / sqrt(2 * (49 + 1 + 64) / 9)
    assert pearson(x, y).item() == pytest.approx(5 / math.sqrt(2 * 114 / 9))
    assert pearson(x, torch.ones(3)).item() == 0.0
    # the longer answer always scored up by 1: the score difference follows the length difference exactly
    len_a, len_b = torch.tensor([5.0, 3.0, 5.0, 3.0]), torch.tensor([3.0, 5.0, 3.0, 5.0])
    score_b = torch.tensor([0.2, -0.4, 1.0, 0.3])
    score_a = score_b + (len_a - len_b).sign()
    assert length_correlation(score_a, score_b, len_a, len_b).item() == pytest.approx(1.0)
    assert length_bias(score_a, score_b, len_a, len_b) == pytest.approx(
        {"length_correlation": 1.0, "longer_preferred": 1.0}
    )
    biased_short = length_bias(score_b, score_a, len_a, len_b)
    assert biased_short == pytest.approx({"length_correlation": -1.0, "longer_preferred": 0.0})
    even = torch.tensor([3.0, 5.0, 7.0, 1.0])  # the longer one wins the first two pairs and loses the others
    unbiased = length_bias(torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0.0, 1.0, 0.0, 1.0]), len_a, even)
    assert unbiased == pytest.approx({"length_correlation": 0.0, "longer_preferred": 0.5})
