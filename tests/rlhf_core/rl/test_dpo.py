"""Offline DPO: pairs tokenized as TRL 1.16 does on tokenizers of real shapes, one forward of a batch of pairs
against each pair alone, the reference's three forms, and short runs on the smoke world: margins up, TRL's metric
names, a crash and rerun ending on bit-identical weights (TR-DPO's reference included)."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.config import DPOConfig, RLConfig, RunConfig
from rlhf_core.data.chat import encode, end_at_turn_end, render_completions
from rlhf_core.data.rows import DataValidationError
from rlhf_core.demo.world import world_rows
from rlhf_core.models.loading import load_causal_lm, load_tokenizer, stop_token_ids
from rlhf_core.rl.dpo import PairBatch, Reference, tokenize_preferences, train_dpo
from rlhf_core.rl.dpo_losses import sequence_logps
from rlhf_core.rl.inputs import rl_inputs
from tests.fixtures.real_shapes import FAMILIES, build_family, family, is_chat


def family_rows(tokenizer, spec) -> list[dict]:
    """Two pairs as the data stage hands them: templated for the instruct families, plain text for the base ones."""
    questions = [("is the sky blue", " yes it is", " no"), ("name a colour", " red", " the number seven")]
    if not is_chat(spec):
        return [{"prompt": q, "chosen": c, "rejected": r} for q, c, r in questions]
    rows = []
    for q, c, r in questions:
        user = [{"role": "user", "content": q}]
        answers = [[{"role": "assistant", "content": a.strip()}] for a in (c, r)]
        prompt, (chosen, rejected) = render_completions(tokenizer, user, answers)
        # as the data stage renders them: a completion ends at its end of turn (rlhf_core/data/rows.py)
        rows.append({"prompt": prompt, "chosen": end_at_turn_end(chosen), "rejected": end_at_turn_end(rejected)})
    return rows


@pytest.mark.parametrize("name", FAMILIES)
def test_a_pair_is_its_prompt_then_each_completion_closed_once(tmp_path, name):
    from transformers import GenerationConfig

    path, spec = build_family(name, tmp_path), family(name)
    tok = load_tokenizer(str(path))
    stops = stop_token_ids(tok, GenerationConfig.from_pretrained(str(path)))
    rows = family_rows(tok, spec)
    items = tokenize_preferences(tok, rows, max_prompt_length=64, max_length=128, stop_ids=stops)
    for row, item in zip(rows, items):
        for side in ("chosen", "rejected"):
            whole = encode(tok, [row["prompt"] + row[side]])[0]
            got = item["prompt"] + item[side]
            # the text's own tokens, then one closing token: eos appended unless the template's end of turn is there
            assert got[: len(whole)] == whole and len(got) - len(whole) in (0, 1)
            assert got[-1] in stops and sum(t in stops for t in item[side]) == 1, (name, side, item[side])
            # a base model's pair ends on eos, appended (TRL's add_eos); pad == eos changes nothing
            if not is_chat(spec):
                assert item[side][-1] == tok.eos_token_id and len(got) == len(whole) + 1
        assert item["prompt"] == encode(tok, [row["prompt"]])[0]


def test_a_long_pair_is_cut_as_trl_cuts_it_and_a_prompt_without_room_is_refused(smoke_world):
    tok = load_tokenizer(str(smoke_world.tokenizer))
    row = world_rows(smoke_world, "preference")[0]
    full = tokenize_preferences(tok, [row], max_prompt_length=64, max_length=128)[0]
    width = len(full["prompt"]) + 2
    (cut,) = tokenize_preferences(tok, [row], max_prompt_length=64, max_length=width)
    assert cut["prompt"] == full["prompt"] and cut["chosen"] == full["chosen"][:2]  # keep_start: the end is lost
    short = tokenize_preferences(tok, [row], max_prompt_length=3, max_length=128)[0]
    assert short["prompt"] == full["prompt"][-3:]  # a prompt keeps its last tokens, as every RL prompt
    with pytest.raises(DataValidationError, match=r"data.preference row 0: its prompt takes \d+ of data.max_length"):
        tokenize_preferences(tok, [row], max_prompt_length=64, max_length=len(full["prompt"]) + 1)


def pair_items(world, n=4):
    tok = load_tokenizer(str(world.tokenizer))
    rows = world_rows(world, "preference")[:n]
    return tok, tokenize_preferences(tok, rows, max_prompt_length=24, max_length=48)


def test_one_forward_of_padded_pairs_gives_each_pair_alone(smoke_world):
    tok, items = pair_items(smoke_world)
    model = load_causal_lm(str(smoke_world.base_model)).eval()
    batch = PairBatch.of(items, tok.pad_token_id)
    with torch.no_grad():
        chosen, rejected = sequence_logps(batch.logps(model), batch.resp_mask)
        for sums, side in ((chosen, "chosen"), (rejected, "rejected")):
            for i, item in enumerate(items):  # the loop: prompt + completion, unpadded, summed by hand
                ids = torch.tensor([item["prompt"] + item[side]])
                logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
                targets = ids[0, 1:]
                start = len(item["prompt"]) - 1
                alone = logp[torch.arange(start, len(targets)), targets[start:]].sum()
                torch.testing.assert_close(sums[i], alone, atol=1e-5, rtol=1e-5)


def test_the_reference_free_precomputed_and_adapter_disabled_forms(smoke_world):
    from peft import LoraConfig, get_peft_model

    tok, items = pair_items(smoke_world)
    batch, indices = PairBatch.of(items, tok.pad_token_id), list(range(len(items)))
    copy = load_causal_lm(str(smoke_world.base_model)).eval()
    on_the_fly = Reference(DPOConfig(), copy, None).of(batch, indices)
    precomputed = Reference(DPOConfig(), copy, None)
    precomputed.precompute(items, tok.pad_token_id, batch_size=3, device="cpu")  # batches of 3 and 1
    assert precomputed.model is None  # the copy is not needed after
    for a, b in zip(on_the_fly, precomputed.of(batch, [2, 0]), strict=True):
        torch.testing.assert_close(a[[2, 0]], b)
    free = Reference(DPOConfig(reference_free=True), copy, None).of(batch, indices)
    assert all(torch.equal(side, torch.zeros(len(items))) for side in free)
    # LoRA: the policy with its adapters disabled is the base model, adapters trained or not
    lora = get_peft_model(load_causal_lm(str(smoke_world.base_model)), LoraConfig(r=4, target_modules=["q_proj"]))
    with torch.no_grad():
        for param in (p for n, p in lora.named_parameters() if "lora_B" in n):
            param.fill_(0.5)  # adapters that change the output
    disabled = Reference(DPOConfig(), None, lora).of(batch, indices)
    for a, b in zip(on_the_fly, disabled, strict=True):
        torch.testing.assert_close(a, b)
    assert not torch.allclose(sequence_logps(batch.logps(lora), batch.resp_mask)[0], on_the_fly[0])


RL = dict(learning_rate=3e-3, log_steps=1)


def run(world, out, steps=6, on_log=None, save_steps=2, **dpo):
    tok = load_tokenizer(str(world.tokenizer))
    policy = load_causal_lm(str(world.base_model))
    dpo = DPOConfig(**dpo)
    reference = None if dpo.reference_free else load_causal_lm(str(world.base_model))
    logs = []

    def log(metrics, step):
        logs.append((step, metrics))
        if on_log:
            on_log(metrics, step)

    result = train_dpo(
        rl_inputs(
            policy,
            tok,
            world_rows(world, "preference")[:16],
            out,
            reference=reference,
            rl=RLConfig(
                algorithm="dpo",
                total_steps=steps,
                batch_size=8,
                gradient_accumulation_steps=2,
                **RL,
                save_steps=save_steps,
            ),
            dpo=dpo,
            run=RunConfig(device="cpu", seed=3),
            max_prompt_length=24,
            on_log=log,
            show_progress=False,
        )
    )
    return policy, reference, result, logs


def test_a_short_run_separates_the_pairs_and_logs_trl_names(tmp_path, smoke_world):
    _, _, result, logs = run(smoke_world, tmp_path / "d", steps=8, save_steps=8)
    first, last = logs[0][1], logs[-1][1]
    names = {"loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"}
    assert names | {"logps/chosen", "logps/rejected"} <= set(last)
    assert abs(first["rewards/margins"]) < 1e-6  # step 1: the policy is the reference
    # 16 pairs seen four times: the policy separates them (margins about 0.2, accuracy 1 at step 8)
    assert last["rewards/margins"] > 0.1 and last["rewards/accuracies"] > 0.8 and last["loss"] < first["loss"] - 0.05
    assert result.step == 8 and result.checkpoint.name == "checkpoint-8"


def test_a_crash_and_rerun_ends_on_the_same_weights_of_the_policy_and_the_synced_reference(tmp_path, smoke_world):
    tr_dpo = {"sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.5}
    straight, straight_ref, _, _ = run(smoke_world, tmp_path / "a", steps=4, **tr_dpo)

    def crash(metrics, step):
        if step == 3:
            raise RuntimeError("injected crash")

    with pytest.raises(RuntimeError, match="injected crash"):
        run(smoke_world, tmp_path / "b", steps=4, on_log=crash, **tr_dpo)
    resumed, resumed_ref, result, _ = run(smoke_world, tmp_path / "b", steps=4, **tr_dpo)
    assert result.resumed_from == 2
    for a_model, b_model in ((straight, resumed), (straight_ref, resumed_ref)):
        for (name, a), (_, b) in zip(a_model.named_parameters(), b_model.named_parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{name} differs after the rerun")
    # TR-DPO moved the reference toward the policy every step, and the checkpoint kept it
    base = load_causal_lm(str(smoke_world.base_model))
    assert not torch.equal(next(straight_ref.parameters()), next(base.parameters()))
