"""Parity of `rlhf_core.grpo` with TRL 1.16's `GRPOTrainer`, driven through TRL's own code.

Nothing here re-implements TRL: every expected value comes out of a real `trl.GRPOTrainer` built
offline around a tiny seeded Llama (vocabulary 64, one layer) and a word-level tokenizer made in
memory. Our side gets the very same tensors.

- Advantages: TRL's `_generate_and_score_completions` runs for real, with only generation
  (`_generate`: fixed completions) and reward calling (`_calculate_rewards`: a fixed
  rewards-per-function tensor with NaN for None) replaced; its `advantages` output is compared with
  `grpo_advantages` on the same per-source rewards. Tolerance: atol 1e-6, rtol 1e-5 (float32).
- Losses: `trainer._compute_loss(model, inputs)` (TRL's fused, temperature-scaled log-probability
  head included) against `reduce_loss(grpo_token_loss(response_logprobs(...)))`: the loss value,
  the gradient of every model parameter and TRL's logged statistics (entropy, kl, clip ratios).
  Tolerance: atol 1e-6, rtol 1e-5 on the loss and the statistics, atol 1e-6 on each gradient
  entry (gradients are O(0.1)).
- The training loop: one real `train_grpo` step with fixed reward values; the advantages and the
  reward statistics it reports are compared with what TRL computes and logs for the same rewards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from rlhf_core.config import GRPOConfig as OurGRPOConfig
from rlhf_core.config import RLConfig, RunConfig
from rlhf_core.grpo import (
    function_reward,
    grpo_advantages,
    grpo_token_loss,
    high_entropy_mask,
    nanstd,
    reduce_loss,
    stat_mean,
    train_grpo,
)
from rlhf_core.rl_math import masked_mean, response_mask
from rlhf_core.rollout import response_logprobs

NAN = float("nan")
VOCAB = 64
PAD, EOS = 0, 1
MAX_COMPLETION = 6
TOL = dict(atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------
# offline fixtures: tokenizer, tiny model, TRL trainer
# ------------------------------------------------------------------------------------------


def build_tokenizer():
    """A word-level tokenizer: <pad> 0, </s> 1, <unk> 2, then w0..w60 (ids 3..63)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "</s>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def build_policy(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config)


def named_reward(name: str):
    def reward(completions, **_):  # never called: `_calculate_rewards` is replaced
        raise AssertionError("TRL's reward functions should not run in these tests")

    reward.__name__ = name
    return reward


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def make_trainer(tokenizer, tmp_path_factory):
    """make_trainer(temperature=, reward_names=, model=, **GRPOConfig fields) -> a real trl.GRPOTrainer.

    beta stays 0 at construction (with beta > 0 TRL would load a reference model from the hub);
    the loss tests set `trainer.beta` afterwards, which is all `_compute_loss` reads.
    """
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    dataset = Dataset.from_dict({"prompt": ["w3 w4 w5", "w6 w7 w8", "w9 w10 w11", "w12 w13 w14"]})

    def make(temperature: float = 1.0, reward_names=("r0",), model=None, **overrides):
        args = GRPOConfig(
            output_dir=str(tmp_path_factory.mktemp("trl_grpo")),
            use_cpu=True,
            bf16=False,
            report_to=[],
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=MAX_COMPLETION,
            temperature=temperature,
            gradient_checkpointing=False,
            save_strategy="no",
            logging_steps=1,
            **overrides,
        )
        trainer = GRPOTrainer(
            model=model if model is not None else build_policy(),
            args=args,
            reward_funcs=[named_reward(n) for n in reward_names],
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        trainer.model.train()  # `mode` is "train" in TRL's code paths
        return trainer

    return make


# ------------------------------------------------------------------------------------------
# advantages: TRL's _generate_and_score_completions against grpo_advantages
# ------------------------------------------------------------------------------------------


def fake_completions(batch: int, truncated_every: int = 0) -> list[list[int]]:
    """Completion ids as TRL's generation returns them: up to and including eos, or cut at the maximum."""
    out = []
    for i in range(batch):
        if truncated_every and i % truncated_every == 0:
            out.append([3 + (i + j) % 60 for j in range(MAX_COMPLETION)])  # never stopped
        else:
            n = 1 + i % (MAX_COMPLETION - 1)
            out.append([3 + (i * 7 + j) % 60 for j in range(n)] + [EOS])
    return out


def drive_trl_scoring(trainer, per_source: torch.Tensor, completions: list[list[int]] | None = None) -> dict:
    """Run TRL's real `_generate_and_score_completions` on fixed completions and fixed rewards (B, F)."""
    batch = per_source.shape[0]
    G = trainer.num_generations
    prompt_ids = [[3 + g % 20, 4 + g % 20, 5 + g % 20] for g in range(batch // G) for _ in range(G)]
    completion_ids = completions if completions is not None else fake_completions(batch)
    texts = trainer.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
    trainer._generate = lambda prompts: (prompt_ids, completion_ids, None, texts, None, {}, None, [])
    trainer._calculate_rewards = lambda inputs, prompts, completions, ids: per_source.clone()
    trainer._metrics["train"].clear()
    inputs = [{"prompt": f"w{3 + i // G} w{4 + i // G}"} for i in range(batch)]
    return trainer._generate_and_score_completions(inputs)


def scenario_groups() -> torch.Tensor:
    """(20, 3), groups of 4: full, partly None with an unscorable row, one scorable row, all unscorable, zero std."""
    return torch.tensor(
        [
            [1.0, 0.5, 2.0],
            [2.0, -1.0, 0.0],
            [0.5, 0.25, 1.0],
            [3.0, 2.0, -1.0],  # every source scored
            [1.0, NAN, 2.0],
            [NAN, NAN, NAN],
            [NAN, 1.5, NAN],
            [0.0, NAN, 0.5],  # partly None, one unscorable row
            [NAN, NAN, NAN],
            [NAN, 2.0, NAN],
            [NAN, NAN, NAN],
            [NAN, NAN, NAN],  # a single scorable row: std NaN
            [NAN, NAN, NAN],
            [NAN, NAN, NAN],
            [NAN, NAN, NAN],
            [NAN, NAN, NAN],  # a whole unscorable group
            [1.0, 1.0, 1.0],
            [1.0, 1.0, 1.0],
            [1.0, 1.0, 1.0],
            [1.0, 1.0, NAN],  # zero std (one source None)
        ]
    )


def scenario_random() -> torch.Tensor:
    """(24, 2) seeded rewards, about a third None, plus two unscorable rows."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(24, 2, generator=g) * 3.0
    x[torch.rand(24, 2, generator=g) < 0.35] = NAN
    x[[5, 17]] = NAN
    return x


SCENARIOS = {
    "groups": (scenario_groups, [1.0, 0.5, -2.0]),
    "groups_unit": (scenario_groups, [1.0, 1.0, 1.0]),
    "random": (scenario_random, [0.7, 1.3]),
}


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_advantages_match_trl_generate_and_score(make_trainer, scenario, scale_rewards, aggregation):
    """`grpo_advantages` == the `advantages` output of TRL's `_generate_and_score_completions` on the
    same rewards per function (NaN = None): unscorable rows, partly-None groups, groups with one
    scorable row or zero std, several weighted functions. Tolerance atol 1e-6, rtol 1e-5."""
    make, weights = SCENARIOS[scenario]
    per_source = make()
    names = [f"r{i}" for i in range(per_source.shape[1])]
    trainer = make_trainer(
        reward_names=names, reward_weights=weights, scale_rewards=scale_rewards, multi_objective_aggregation=aggregation
    )
    trl_out = drive_trl_scoring(trainer, per_source)

    ours = grpo_advantages(
        per_source, torch.tensor(weights), trainer.num_generations, scale_rewards=scale_rewards, aggregation=aggregation
    )
    torch.testing.assert_close(ours.advantages, trl_out["advantages"], **TOL)
    unscorable = torch.isnan(per_source).all(dim=1)
    assert torch.equal(ours.unscorable, unscorable) and unscorable.any()
    assert torch.all(ours.advantages[unscorable] == 0) and torch.all(trl_out["advantages"][unscorable] == 0)
    assert ours.advantages.abs().max() > 0.1  # not a trivially zero comparison
    # what TRL logs as frac_reward_zero_std comes from the same std we return
    assert trainer._metrics["train"]["frac_reward_zero_std"][-1] == pytest.approx(
        torch.isclose(ours.std, torch.zeros_like(ours.std)).float().mean().item()
    )


def test_nanstd_matches_trl():
    """`rlhf_core.grpo.nanstd` == `trl.trainer.utils.nanstd` (whole tensor, per dim, keepdim; rows with 0/1 values)."""
    from trl.trainer.utils import nanstd as trl_nanstd

    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4, 3, generator=g)
    x[torch.rand(6, 4, 3, generator=g) < 0.4] = NAN
    x[0, :, 0] = NAN
    x[1, 1:, 1] = NAN  # one value left
    for dim, keepdim in [(None, False), (1, False), (1, True), (0, True)]:
        kwargs = {} if dim is None else {"dim": dim, "keepdim": keepdim}
        torch.testing.assert_close(nanstd(x, **kwargs), trl_nanstd(x, **kwargs), equal_nan=True, **TOL)


def test_truncated_completion_mask_matches_trl(make_trainer):
    """mask_truncated_completions: TRL's `completion_mask` (padded, truncated rows zeroed) == our loop's
    `resp_mask * has_stop` from `response_mask` on the same right-padded completions (exact)."""
    trainer = make_trainer(mask_truncated_completions=True)
    completions = fake_completions(8, truncated_every=3)
    out = drive_trl_scoring(trainer, torch.arange(8.0).view(8, 1), completions)
    resp_mask, _, has_stop = response_mask(out["completion_ids"], (EOS,))
    assert (~has_stop).sum() == 3
    assert torch.equal(out["completion_mask"].long(), (resp_mask * has_stop.unsqueeze(1)).long())
    assert out["num_items_in_batch"].item() == (resp_mask * has_stop.unsqueeze(1)).sum().item()  # dapo's token count
    trainer.mask_truncated_completions = False
    out = drive_trl_scoring(trainer, torch.arange(8.0).view(8, 1), completions)
    assert torch.equal(out["completion_mask"].long(), resp_mask.long())
    assert out["num_items_in_batch"].item() == resp_mask.sum().item()


# ------------------------------------------------------------------------------------------
# losses: TRL's _compute_loss against grpo_token_loss + reduce_loss, value and gradient
# ------------------------------------------------------------------------------------------

B = 8
LENGTHS = [6, 2, 5, 1, 6, 3, 4, 2]


@dataclass(frozen=True)
class LossCase:
    loss_type: str
    level: str = "token"
    beta: float = 0.0
    bias_kl: bool = True
    delta: float | None = None
    top_entropy_quantile: float = 1.0
    temperature: float = 0.7
    on_policy: bool = False  # no old log-probabilities: both sides use the current ones, detached
    epsilon: float = 0.2
    epsilon_high: float = 0.28

    @property
    def id(self) -> str:
        parts = [self.loss_type, self.level]
        if self.beta:
            parts.append(f"beta-biaskl{int(self.bias_kl)}")
        if self.delta:
            parts.append(f"delta{self.delta}")
        if self.top_entropy_quantile < 1:
            parts.append(f"topH{self.top_entropy_quantile}")
        if self.temperature != 0.7:
            parts.append(f"T{self.temperature}")
        if self.on_policy:
            parts.append("onpolicy")
        return "-".join(parts)

    def ours(self) -> OurGRPOConfig:
        return OurGRPOConfig(
            loss_type=self.loss_type,
            importance_sampling_level=self.level,
            beta=self.beta,
            use_bias_correction_kl=self.bias_kl,
            delta=self.delta,
            epsilon=self.epsilon,
            epsilon_high=self.eps_high,
            top_entropy_quantile=self.top_entropy_quantile,
            sapo_temperature_pos=0.9,
            sapo_temperature_neg=1.3,
        )

    @property
    def eps_high(self) -> float:
        return 1.3 if self.loss_type == "cispo" else self.epsilon_high  # cispo: the cap of the ratio


LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"]
CLIPPED = ["grpo", "bnpo", "dr_grpo", "dapo"]
CASES = (
    [
        LossCase(lt, level, beta, bias)
        for lt in LOSS_TYPES
        for level in ("token", "sequence")
        for beta, bias in ((0.0, True), (0.04, True), (0.04, False))
    ]
    + [LossCase(lt, level, beta=0.04, delta=1.5) for lt in CLIPPED for level in ("token", "sequence")]
    + [LossCase(lt, top_entropy_quantile=0.4, beta=0.04) for lt in LOSS_TYPES]
    + [LossCase(lt, "sequence", top_entropy_quantile=0.4) for lt in ("grpo", "dapo")]
    + [LossCase(lt, temperature=1.0, beta=0.04) for lt in LOSS_TYPES]
    + [LossCase(lt, on_policy=True, beta=0.04) for lt in ("grpo", "dapo", "cispo")]
)


@pytest.fixture(scope="module")
def trainers(make_trainer):
    """One TRL trainer per sampling temperature (TRL bakes the temperature into its fused LM head)."""
    return {t: make_trainer(temperature=t, model=build_policy(seed=0)) for t in (0.7, 1.0)}


@pytest.fixture(scope="module")
def batch():
    """Prompts without padding (all length 3, so TRL's default positions equal our mask-derived ones),
    right-padded completions of several lengths, advantages of both signs (one 0)."""
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, VOCAB, (B, 3), generator=g)
    mask = (torch.arange(MAX_COMPLETION)[None] < torch.tensor(LENGTHS)[:, None]).long()
    completion_ids = torch.randint(3, VOCAB, (B, MAX_COMPLETION), generator=g).masked_fill(mask == 0, PAD)
    advantages = torch.randn(B, generator=g)
    advantages[3] = 0.0
    return dict(
        prompt_ids=prompt_ids,
        prompt_mask=torch.ones_like(prompt_ids),
        completion_ids=completion_ids,
        completion_mask=mask,
        advantages=advantages,
        noise=torch.randn(2, B, MAX_COMPLETION, generator=g),
    )


def perturbed(logp: torch.Tensor, noise: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Old / reference log-probabilities: the current ones moved by noise, so ratios are far from 1 (0 on padding, as TRL)."""
    return (logp.detach() + 0.35 * noise) * mask


def configure(trainer, case: LossCase, *, accumulation: int = 1, steps_per_generation: int = 1) -> None:
    """Every attribute TRL's `_compute_loss` reads, set from the case."""
    trainer.loss_type = case.loss_type
    trainer.importance_sampling_level = case.level
    trainer.beta = case.beta
    trainer.epsilon_low, trainer.epsilon_high = case.epsilon, case.eps_high
    trainer.top_entropy_quantile = case.top_entropy_quantile
    trainer.args.use_bias_correction_kl = case.bias_kl
    trainer.args.delta = case.delta
    trainer.args.sapo_temperature_pos, trainer.args.sapo_temperature_neg = 0.9, 1.3
    trainer.args.steps_per_generation = steps_per_generation
    trainer.current_gradient_accumulation_steps = accumulation
    assert trainer.off_policy_mask_threshold is None and not trainer.use_vllm and not trainer._entropy_bonus_enabled


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def trl_loss(trainer, inputs: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
    model = trainer.model
    model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    loss = trainer._compute_loss(model, dict(inputs))
    loss.backward()
    return loss.detach(), grads(model), {k: v[-1] for k, v in trainer._metrics["train"].items()}


def old_and_ref(trainer, batch, temperature):
    with torch.no_grad():
        logp, _ = response_logprobs(
            trainer.model,
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["completion_ids"],
            batch["completion_mask"],
            temperature,
        )
    mask = batch["completion_mask"]
    return perturbed(logp, batch["noise"][0], mask), perturbed(logp, batch["noise"][1], mask)


def trl_inputs(batch, rows, case: LossCase, old, ref, num_items) -> dict:
    inputs = {
        k: batch[k][rows] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
    }
    inputs["num_items_in_batch"] = torch.tensor(num_items)
    if not case.on_policy:
        inputs["old_per_token_logps"] = old[rows]
    if case.beta:
        inputs["ref_per_token_logps"] = ref[rows]
    return inputs


def our_loss(model, batch, rows, case: LossCase, old, ref, *, total_tokens: float):
    """Our loss for the rows, as `train_grpo` computes it for one micro-batch (before its micro-batch scaling)."""
    mask = batch["completion_mask"][rows]
    logp, entropy = response_logprobs(
        model,
        batch["prompt_ids"][rows],
        batch["prompt_mask"][rows],
        batch["completion_ids"][rows],
        mask,
        case.temperature,
        with_entropy=True,
    )
    old_logp = logp.detach() if case.on_policy else old[rows]
    entropy_mask = (
        high_entropy_mask(entropy, mask, case.top_entropy_quantile) if case.top_entropy_quantile < 1 else None
    )
    per_token, stats = grpo_token_loss(
        logp,
        old_logp,
        batch["advantages"][rows],
        mask,
        case.ours(),
        ref_logp=ref[rows] if case.beta else None,
        entropy_mask=entropy_mask,
    )
    loss = reduce_loss(per_token, mask, case.loss_type, max_completion_length=MAX_COMPLETION, total_tokens=total_tokens)
    return loss, stats, entropy, logp, entropy_mask


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_loss_and_gradient_match_trl_compute_loss(trainers, batch, case):
    """Loss value and every parameter's gradient of TRL's `_compute_loss` == ours on the same inputs
    (one process, no accumulation: dapo/cispo normalize by num_items_in_batch = our total_tokens),
    plus TRL's logged entropy / kl / clip-ratio statistics == the loop's `stat_mean` / `masked_mean`
    of our stats. Every loss type, token and sequence level, beta with and without bias-corrected
    KL, delta, top_entropy_quantile < 1, temperature 0.7 and 1, on-policy (no old log-probs).
    Tolerance atol 1e-6 (rtol 1e-5 on the loss and statistics)."""
    trainer = trainers[case.temperature]
    model = trainer.model
    configure(trainer, case)
    old, ref = old_and_ref(trainer, batch, case.temperature)
    rows = slice(None)
    mask = batch["completion_mask"]
    num_items = int(mask.sum())

    loss_trl, grads_trl, metrics = trl_loss(trainer, trl_inputs(batch, rows, case, old, ref, num_items))
    model.zero_grad(set_to_none=True)
    loss_ours, stats, entropy, logp, entropy_mask = our_loss(
        model, batch, rows, case, old, ref, total_tokens=float(num_items)
    )
    loss_ours.backward()
    grads_ours = grads(model)

    torch.testing.assert_close(loss_ours.detach(), loss_trl, **TOL)
    assert grads_ours.keys() == grads_trl.keys() and len(grads_ours) == len(list(model.parameters()))
    for name in grads_trl:
        torch.testing.assert_close(
            grads_ours[name], grads_trl[name], atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )
    assert max(g.abs().max() for g in grads_trl.values()) > 1e-2  # gradients are not trivially zero

    # the data exercises what the case is about
    log_ratio = (logp.detach() - (logp.detach() if case.on_policy else old)) * mask
    if case.level == "sequence":
        log_ratio = (log_ratio.sum(1) / mask.sum(1)).unsqueeze(1).expand_as(mask) * mask
    ratio = torch.exp(log_ratio)[mask.bool()]
    if not case.on_policy:
        if case.loss_type in CLIPPED:
            assert (ratio < 1 - case.epsilon).any() and (ratio > 1 + case.eps_high).any()
        if case.loss_type == "cispo":
            assert (ratio > case.eps_high).any() and (ratio < case.eps_high).any()
        if case.delta:
            assert (ratio > case.delta).any()
    if entropy_mask is not None:
        assert 0 < entropy_mask.sum() < mask.sum()

    # TRL's logged statistics against the loop's reductions of ours
    torch.testing.assert_close(masked_mean(entropy, mask).item(), metrics["entropy"], **TOL)
    if case.beta:
        torch.testing.assert_close(masked_mean(stats["kl"].detach(), mask).item(), metrics["kl"], **TOL)
    if case.loss_type == "cispo":
        torch.testing.assert_close(stat_mean(stats["cispo_clipped"], mask).item(), metrics["cispo_clip_ratio"], **TOL)
    elif case.loss_type in CLIPPED:
        low, high = stats["low_clipped"], stats["high_clipped"]
        torch.testing.assert_close(stat_mean(low, mask).item(), metrics["clip_ratio/low_mean"], **TOL)
        torch.testing.assert_close(stat_mean(high, mask).item(), metrics["clip_ratio/high_mean"], **TOL)
        torch.testing.assert_close(
            stat_mean(torch.maximum(low, high), mask).item(), metrics["clip_ratio/region_mean"], **TOL
        )


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_logprobs_entropies_and_entropy_mask_match_trl(trainers, batch, temperature):
    """`response_logprobs` (log-probs and entropies of temperature-scaled logits) == TRL's
    `_get_per_token_logps_and_entropies` on the real completion tokens (atol 1e-5), and
    `high_entropy_mask` == TRL's `get_high_entropy_mask` (exact) for several quantiles."""
    trainer = trainers[temperature]
    b = batch
    mask = b["completion_mask"]
    with torch.no_grad():
        trl_logp, trl_entropy, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([b["prompt_ids"], b["completion_ids"]], 1),
            torch.cat([b["prompt_mask"], mask], 1),
            MAX_COMPLETION,
            compute_entropy=True,
        )
        logp, entropy = response_logprobs(
            trainer.model, b["prompt_ids"], b["prompt_mask"], b["completion_ids"], mask, temperature, with_entropy=True
        )
    real = mask.bool()
    torch.testing.assert_close(logp[real], trl_logp[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy[real], trl_entropy[real], atol=1e-5, rtol=1e-5)
    for quantile in (0.2, 0.4, 0.5, 0.8, 1.0):
        ours = high_entropy_mask(entropy, mask, quantile)
        theirs = trainer.get_high_entropy_mask(trl_entropy, mask, 1 - quantile)
        assert torch.equal(ours, theirs), quantile
        assert ours.sum() >= 1 and (ours <= real).all()


@pytest.mark.parametrize("accumulation,steps_per_generation", [(2, 2), (2, 4)])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_accumulated_micro_batches_match_trl(trainers, batch, loss_type, accumulation, steps_per_generation):
    """One optimizer step accumulated over micro-batches: TRL with current_gradient_accumulation_steps and
    steps_per_generation (num_items_in_batch = tokens of the whole generation batch) == our loop's
    normalization (dapo/cispo: total_tokens = generation tokens / (steps_per_generation //
    accumulation); the others: each micro-batch's loss x micro rows / optimizer-batch rows).
    Summed loss and gradients, atol 1e-6."""
    case = LossCase(loss_type, beta=0.04)
    trainer = trainers[case.temperature]
    model = trainer.model
    configure(trainer, case, accumulation=accumulation, steps_per_generation=steps_per_generation)
    old, ref = old_and_ref(trainer, batch, case.temperature)
    micro = B // steps_per_generation  # TRL: per_device_train_batch_size rows of the generation batch per step
    optimizer_batch = micro * accumulation  # rl.batch_size
    num_items = int(batch["completion_mask"].sum())  # the whole generation batch, as TRL passes it
    windows = [slice(s, s + micro) for s in range(0, optimizer_batch, micro)]  # the first optimizer step

    model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    loss_trl = sum(trainer._compute_loss(model, trl_inputs(batch, rows, case, old, ref, num_items)) for rows in windows)
    loss_trl.backward()
    grads_trl = grads(model)

    model.zero_grad(set_to_none=True)
    total_tokens = num_items / (steps_per_generation // accumulation)  # as train_grpo, one process
    loss_ours = 0.0
    for rows in windows:
        loss, *_ = our_loss(model, batch, rows, case, old, ref, total_tokens=total_tokens)
        if loss_type not in ("dapo", "cispo"):
            loss = loss * (micro / optimizer_batch)
        loss_ours = loss_ours + loss
    loss_ours.backward()
    grads_ours = grads(model)

    torch.testing.assert_close(loss_ours.detach(), loss_trl.detach(), **TOL)
    for name in grads_trl:
        torch.testing.assert_close(
            grads_ours[name], grads_trl[name], atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )


# ------------------------------------------------------------------------------------------
# the training loop: one real train_grpo step against TRL's scoring of the same rewards
# ------------------------------------------------------------------------------------------

LOOP_REWARDS = {  # 16 completions, groups of 4; None = the function returned None
    "length": [1.0, 2.0, None, 4.0, None, None, None, 2.0, 3.0, 3.0, 3.0, 3.0, None, None, None, None],
    "odd": [0.5, None, None, 1.0, 2.0, None, 1.0, None, None, 1.0, 2.0, 0.0, None, None, None, None],
}
LOOP_WEIGHTS = {"length": 1.0, "odd": -0.5}


@pytest.mark.parametrize(
    "aggregation,scale_rewards",
    [
        ("sum_then_normalize", "group"),
        ("sum_then_normalize", "batch"),
        ("sum_then_normalize", "none"),
        ("normalize_then_sum", "group"),
    ],
)
def test_train_grpo_step_advantages_and_reward_metrics_match_trl(
    make_trainer, tokenizer, tmp_path, aggregation, scale_rewards
):
    """One `train_grpo` step (tiny policy, two reward functions returning fixed values with None) ->
    the advantages in its completions table and its logged `reward`, `reward_std`,
    `frac_reward_zero_std`, `rewards/<name>/mean|std` == TRL's `_generate_and_score_completions`
    output and `_metrics` for the same rewards (README: "Metrics with TRL's names").
    Tolerance atol 1e-5, rtol 1e-5 (the loop's metrics pass through floats)."""

    def source(name):
        def fn(prompts, completions, **_):
            assert len(completions) == 16
            return list(LOOP_REWARDS[name])

        return function_reward(name, LOOP_WEIGHTS[name], fn)

    logs, tables = [], []
    rows = [{"prompt": p} for p in ("w3 w4 w5", "w6 w7 w8", "w9 w10 w11", "w12 w13 w14")]
    train_grpo(
        build_policy(seed=0),
        None,
        [source("length"), source("odd")],
        tokenizer,
        rows,
        RLConfig(
            algorithm="grpo",
            total_steps=1,
            batch_size=16,
            response_length=MAX_COMPLETION,
            temperature=0.7,
            learning_rate=1e-3,
        ),
        OurGRPOConfig(num_generations=4, multi_objective_aggregation=aggregation, scale_rewards=scale_rewards),
        RunConfig(device="cpu", seed=3),
        max_prompt_length=8,
        output_dir=tmp_path / "grpo",
        on_log=lambda m, s: logs.append(m),
        on_completions=lambda table, s: tables.append(table),
        show_progress=False,
    )
    table = tables[0]
    assert [[r["length"], r["odd"]] for r in table] == [list(v) for v in zip(*LOOP_REWARDS.values())]

    per_source = torch.tensor([[NAN if v is None else v for v in col] for col in LOOP_REWARDS.values()]).T
    trainer = make_trainer(
        reward_names=list(LOOP_REWARDS),
        reward_weights=list(LOOP_WEIGHTS.values()),
        scale_rewards=scale_rewards,
        multi_objective_aggregation=aggregation,
    )
    out = drive_trl_scoring(trainer, per_source)
    torch.testing.assert_close(torch.tensor([r["advantage"] for r in table]), out["advantages"], atol=1e-5, rtol=1e-5)

    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    keys = ["reward", "reward_std", "frac_reward_zero_std"] + [
        f"rewards/{n}/{s}" for n in LOOP_REWARDS for s in ("mean", "std")
    ]
    mismatches = {
        k: (logs[0][k], trl_metrics[k])
        for k in keys
        if not math.isclose(logs[0][k], trl_metrics[k], rel_tol=1e-5, abs_tol=1e-5)
    }
    assert not mismatches, f"ours vs TRL's logged metric: {mismatches}"
