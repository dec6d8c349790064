"""DPO parity with TRL 1.16: `rlhf_core.rl.dpo_losses.dpo_loss` against TRL's own `DPOTrainer._compute_loss`.

Every expected value comes out of a real `trl.DPOTrainer`, built once for the module, offline, around the tiny
seeded Llama of tests/parity/trl_grpo_common.py (vocabulary 64, one layer), a word-level tokenizer and four
prompt/chosen/rejected pairs; TRL tokenizes them (eos appended to each completion) and its own collator makes
the batch: [chosen rows; rejected rows], prompt + completion right-padded, prompts of 1 to 4 tokens,
completions of 2 to 6. Our side reads the same tokenized rows as left-padded prompts and right-padded
completions through the repository's forward (`response_logprobs`, INVALID_LOGPROB on padding) into
`dpo_loss`. Both run on the same weights; TRL's fused LM head (log-probs in chunks, no logits) against our plain
forward is checked token by token first.

For each loss type of LOSS_TYPES (beta 0.1; hinge 0.5 so that two pairs sit on relu's flat side; exo_pair
label_smoothing 1e-3, robust and aot 0.1; discopop tau 0.1), two weighted combinations and reference_free (TRL:
zero reference log-probs), with fixed reference log-probs in the batch as `precompute_ref_log_probs` puts them
there; and, with a real reference model (a second seeded Llama) whose forward TRL runs itself, sigmoid and the
weighted sigmoid + sft. Compared: the loss, the gradient of every model parameter and TRL's six logged
rewards/* and logps/* metrics. The trainer's settings are the attributes `_compute_loss` reads, set per case.

Tolerance: atol 1e-6, rtol 1e-5 (float32, CPU) on the loss, the metrics and each gradient entry; the largest
differences reached are printed with -s or -rA (`report_max_diffs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from rlhf_core.models.forward import response_logprobs
from rlhf_core.rl.dpo_losses import LOSS_TYPES, DPOLossSpec, dpo_loss, sequence_logps
from tests.parity.max_diffs import record_max_diff
from tests.parity.trl_grpo_common import PAD, build_policy, build_tokenizer

pytestmark = pytest.mark.usefixtures("report_max_diffs")

ATOL, RTOL = 1e-6, 1e-5
PAIRS = {  # prompts of 1 to 4 words, completions of 1 to 5 (TRL appends the eos)
    "prompt": ["w3 w4 w5", "w6 w7", "w9 w10 w11 w12", "w13"],
    "chosen": [" w20 w21", " w22 w23 w24 w25", " w26", " w27 w28 w29"],
    "rejected": [" w30 w31 w32", " w33", " w34 w35", " w36 w37 w38 w39 w40"],
}
# the policy's summed log-probs are chosen [-12.35, -20.91, -8.64, -16.35], rejected [-16.60, -8.30, -12.76,
# -24.92]: log-ratios chosen [0.65, -1.91, 1.36, -0.85], rejected [-1.60, 2.20, 8.24, -10.42], so the pairs'
# deltas have both signs; reference chosen - rejected [2, -8.5, 11, -1] sorts in another order than the
# policy's [4.25, -12.62, 4.12, 8.56] (aot)
REF_CHOSEN = [-13.0, -19.0, -10.0, -15.5]
REF_REJECTED = [-15.0, -10.5, -21.0, -14.5]
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


@dataclass(frozen=True)
class Case:
    loss_types: tuple[str, ...]
    loss_weights: tuple[float, ...] | None = None
    beta: float = 0.1
    label_smoothing: float = 0.0
    discopop_tau: float = 0.1
    reference: str = "fixed"  # fixed: precomputed values in the batch; zero: reference_free; model: TRL's forward

    @property
    def id(self) -> str:
        weights = "-w" + "_".join(map(str, self.loss_weights)) if self.loss_weights else ""
        return "+".join(self.loss_types) + weights + ("" if self.reference == "fixed" else f"-ref_{self.reference}")

    def spec(self) -> DPOLossSpec:
        return DPOLossSpec(
            loss_types=self.loss_types,
            loss_weights=self.loss_weights,
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            discopop_tau=self.discopop_tau,
            reference_free=self.reference == "zero",
        )


SETTINGS = {"hinge": dict(beta=0.5), "exo_pair": dict(label_smoothing=1e-3), "robust": dict(label_smoothing=0.1)}
SETTINGS["aot"] = dict(label_smoothing=0.1)
CASES = [Case((lt,), **SETTINGS.get(lt, {})) for lt in LOSS_TYPES] + [
    Case(("sigmoid", "sft"), (0.8, 0.2)),
    Case(("ipo", "aot", "apo_down"), (0.5, 1.5, -0.25), label_smoothing=0.1),
    Case(("sigmoid",), reference="zero"),
    Case(("sigmoid",), reference="model"),
    Case(("sigmoid", "sft"), (0.8, 0.2), reference="model"),
]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """A real trl.DPOTrainer with a reference model (a second seeded Llama): cases with fixed reference log-probs
    set `precompute_ref_logps`, which is all `_compute_loss` reads of precompute_ref_log_probs."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl_dpo")),
        use_cpu=True,
        bf16=False,
        report_to=[],
        per_device_train_batch_size=4,
        gradient_checkpointing=False,
        save_strategy="no",
        logging_steps=1,
    )
    trainer = DPOTrainer(
        model=build_policy(seed=0),
        ref_model=build_policy(seed=1),
        args=args,
        train_dataset=Dataset.from_dict(PAIRS),
        processing_class=build_tokenizer(),
    )
    trainer.model.train()  # `mode` is "train" in TRL's code paths
    assert trainer.f_divergence_type == "reverse_kl" and not trainer.use_weighting and trainer.ld_alpha is None
    assert not trainer.aux_loss_enabled and not trainer.precompute_ref_logps
    return trainer


def pad(seqs: list[list[int]], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, seqs))
    ids = [[PAD] * (width - len(s)) + s if left else s + [PAD] * (width - len(s)) for s in seqs]
    mask = [[0] * (width - len(s)) + [1] * len(s) if left else [1] * len(s) + [0] * (width - len(s)) for s in seqs]
    return torch.tensor(ids), torch.tensor(mask)


@pytest.fixture(scope="module")
def batches(trainer):
    """TRL's batch (its collator on its tokenized rows) and ours (the same rows: left-padded prompts, twice, then
    right-padded completions [chosen; rejected]); both hold the same tokens in the same order."""
    rows = [trainer.train_dataset[i] for i in range(len(PAIRS["prompt"]))]
    theirs = trainer.data_collator(rows)
    query_ids, query_mask = pad([r["prompt_ids"] for r in rows] * 2, left=True)
    responses, resp_mask = pad([r["chosen_ids"] for r in rows] + [r["rejected_ids"] for r in rows], left=False)
    ours = dict(query_ids=query_ids, query_mask=query_mask, responses=responses, resp_mask=resp_mask)
    # the layouts differ, the tokens do not
    for i in range(2 * len(rows)):
        real = theirs["input_ids"][i][theirs["attention_mask"][i].bool()]
        assert torch.equal(real, torch.cat([query_ids[i][query_mask[i].bool()], responses[i][resp_mask[i].bool()]]))
        assert theirs["completion_mask"][i].sum() == resp_mask[i].sum()
    assert len(set(query_mask[:4].sum(1).tolist())) == 4 and len(set(resp_mask.sum(1).tolist())) > 3
    return theirs, ours


def close(name: str, ours: torch.Tensor, theirs: torch.Tensor) -> None:
    ours, theirs = torch.as_tensor(ours).double(), torch.as_tensor(theirs).double()
    diff = (ours - theirs).abs()
    record_max_diff(name, diff.max().item())
    bad = diff > ATOL + RTOL * theirs.abs()
    assert not bad.any(), f"{name}: max abs diff {diff.max().item():.3g}\nours:\n{ours}\nTRL 1.16:\n{theirs}"


def configure(trainer, case: Case) -> None:
    """The attributes of TRL's trainer that `_compute_loss` reads."""
    trainer.loss_types = list(case.loss_types)
    trainer.loss_weights = list(case.loss_weights or [1.0] * len(case.loss_types))
    trainer.beta = case.beta
    trainer.label_smoothing = case.label_smoothing
    trainer.args.discopop_tau = case.discopop_tau
    trainer.precompute_ref_logps = case.reference != "model"


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def trl_side(trainer, batch: dict, case: Case):
    configure(trainer, case)
    inputs = dict(batch)
    if case.reference != "model":
        zero = case.reference == "zero"
        inputs["ref_chosen_logps"] = torch.zeros(4) if zero else torch.tensor(REF_CHOSEN)
        inputs["ref_rejected_logps"] = torch.zeros(4) if zero else torch.tensor(REF_REJECTED)
    model = trainer.model
    model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    loss = trainer._compute_loss(model, inputs, False)
    loss.backward()
    return loss.detach(), grads(model), {name: trainer._metrics["train"][name][-1] for name in METRICS}


def summed_logps(model, batch: dict, grad: bool = True):
    with torch.set_grad_enabled(grad):
        logp, _ = response_logprobs(model, **batch)
    return logp, sequence_logps(logp, batch["resp_mask"])


def our_side(trainer, batch: dict, case: Case):
    model = trainer.model
    model.zero_grad(set_to_none=True)
    logp, _ = summed_logps(model, batch)
    if case.reference == "model":
        _, (ref_chosen, ref_rejected) = summed_logps(trainer.ref_model, batch, grad=False)
    else:  # reference_free ignores them: values that would show if it did not
        ref_chosen, ref_rejected = torch.tensor(REF_CHOSEN), torch.tensor(REF_REJECTED)
    out = dpo_loss(logp, batch["resp_mask"], ref_chosen, ref_rejected, case.spec())
    out.loss.backward()
    return out.loss.detach(), grads(model), out.metrics


def test_our_forward_gives_trls_fused_head_log_probs(trainer, batches):
    """TRL's fused LM head (chunked log-softmax, no logits) and our plain forward on the same weights: token by
    token on the completions; TRL's `compute_ref_log_probs` (the precompute path) == our summed reference."""
    theirs, ours = batches
    labels = theirs["input_ids"].masked_fill(theirs["completion_mask"] == 0, -100)
    for model in (trainer.model, trainer.ref_model):
        with torch.no_grad():
            fused = model(
                input_ids=theirs["input_ids"],
                attention_mask=theirs["attention_mask"],
                labels=labels,
                fused_lm_head=True,
            ).log_probs
        logp, _ = summed_logps(model, ours, grad=False)
        shifted = theirs["completion_mask"][:, 1:].bool()
        close("per-token log-probs (model)", logp[ours["resp_mask"].bool()], fused[shifted])
    with torch.no_grad():
        ref_chosen, ref_rejected = trainer.compute_ref_log_probs(trainer.ref_model, theirs)
    _, (chosen, rejected) = summed_logps(trainer.ref_model, ours, grad=False)
    close("reference summed log-probs (model)", torch.cat([chosen, rejected]), torch.cat([ref_chosen, ref_rejected]))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_dpo_loss_matches_trl(trainer, batches, case):
    """The loss, every parameter's gradient and the six metrics of `dpo_loss` == TRL's `_compute_loss`."""
    theirs, ours = batches
    loss_trl, grads_trl, metrics_trl = trl_side(trainer, theirs, case)
    loss_ours, grads_ours, metrics_ours = our_side(trainer, ours, case)

    close(f"loss {case.id}", loss_ours, loss_trl)
    assert grads_ours.keys() == grads_trl.keys() and len(grads_trl) == len(list(trainer.model.parameters()))
    for name in grads_trl:
        close(f"gradients {case.id}", grads_ours[name], grads_trl[name])
    assert max(g.abs().max() for g in grads_trl.values()) > 1e-3  # not a trivially zero comparison
    for name in METRICS:
        close(f"metric {name}", metrics_ours[name], metrics_trl[name])
    if case.reference == "fixed":  # the pairs disagree: accuracy strictly between 0 and 1
        assert 0 < metrics_trl["rewards/accuracies"] < 1
