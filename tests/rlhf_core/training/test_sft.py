import torch
from transformers import AutoModelForCausalLM

from rlhf_core.config import RunConfig, SFTConfig
from rlhf_core.demo.world import world_rows
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.training.loop import Hooks
from rlhf_core.training.sft import tokenize_corpus, train_sft


def test_tokenize_corpus_masks_padding(smoke_world):
    tokenizer = load_tokenizer(str(smoke_world.tokenizer))
    data = tokenize_corpus(tokenizer, ["the food was great .", "ok"], max_length=16)
    ids, mask, labels = data.tensors
    assert ids.shape == mask.shape == labels.shape
    assert ids[1, -1] == tokenizer.pad_token_id and labels[1, -1] == -100
    assert ids[0, mask[0].sum() - 1] == tokenizer.eos_token_id  # eos closes every sentence


def test_short_run_changes_every_parameter_lowers_loss_and_saves(tmp_path, smoke_world):
    # given
    tokenizer = load_tokenizer(str(smoke_world.tokenizer))
    model = load_causal_lm(str(smoke_world.base_model))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    texts = [r["text"] for r in world_rows(smoke_world, "text")]
    logs, saved = [], []
    # when
    metrics = train_sft(
        model,
        tokenizer,
        texts,
        SFTConfig(max_steps=12, batch_size=16, learning_rate=3e-3, log_steps=4),
        RunConfig(device="cpu"),
        max_length=40,
        output_dir=tmp_path / "sft",
        hooks=Hooks(
            on_log=lambda m, s: logs.append((s, m)),
            on_checkpoint=lambda p, s: saved.append((p, s)),
            show_progress=False,
        ),
    )
    # then
    assert [s for s, _ in logs] == [4, 8, 12]
    assert metrics["sft/loss"] < metrics["sft/first_loss"] - 0.5
    for name, param in model.named_parameters():
        assert not torch.equal(before[name], param.detach()), f"{name} did not change"
    assert saved == [(tmp_path / "sft", 12)]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "sft")
    batch = tokenizer(["the food was"], return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, model(**batch).logits)
    assert (tmp_path / "sft" / "model.safetensors").is_file() and (tmp_path / "sft" / "tokenizer.json").is_file()


def test_templated_conversations_get_one_bos(tmp_path):
    from rlhf_core.data.chat import render_messages
    from rlhf_core.models.loading import load_tokenizer as load_tok
    from rlhf_core.training.sft import tokenize_corpus
    from tests.fixtures.real_shapes import build_family

    tok = load_tok(str(build_family("llama-3-instruct", tmp_path)))
    text = render_messages(tok, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
    data = tokenize_corpus(tok, [text, "Tell me about the cat."], max_length=64)
    ids, mask, labels = data.tensors
    first = ids[0][mask[0] == 1].tolist()
    assert first == tok(text, add_special_tokens=False)["input_ids"]  # ends with eos <|eot_id|> already
    second = ids[1][mask[1] == 1].tolist()
    assert second == tok("Tell me about the cat." + tok.eos_token)["input_ids"]
    assert (labels[mask == 0] == -100).all()


def test_templated_corpus_is_right_padded_row_by_row():
    from rlhf_core.training.sft import _pad_corpus

    ids, mask, labels = _pad_corpus([[5, 6, 7], [8], [9, 10]], pad_id=0).tensors
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0], [9, 10, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert labels.tolist() == [[5, 6, 7], [8, -100, -100], [9, 10, -100]]
