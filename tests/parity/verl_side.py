"""verl 0.9.1 side of the REINFORCE++ / RLOO parity test: run verl's own functions on the test's tensors.

Run only in a subprocess whose PYTHONPATH starts with .venv/verl-0.9.1 (tests/parity/verl_common.py:
run_verl), so that `import verl` is verl 0.9.1 with its own omegaconf / tensordict / codetiming / torchdata
beside it, and torch, numpy, ray and transformers (5.23, not the 5.5-5.10 verl declares: its imports work
with it) from our venv. Nothing of ours is imported here (the verl directory even holds a top-level
`tests` package of its own). Usage:

    python verl_side.py SPEC.json

SPEC names the inputs (per case: response mask, scores, log-probabilities, reference log-probabilities; the
rows verl sees), the uid of each row, beta, the KL estimator and the gammas; and "extreme" log-probabilities
for `core_algos.kl_penalty` alone. What is verl's code here:
- the token-level scores: the score on the last real token, `reward_tensor[i, valid_response_length - 1]`,
  as verl's NaiveRewardManager writes it (three lines of its __call__, which needs a tokenizer and a
  DataProto of prompts);
- the KL in the reward: `ray_trainer.apply_kl_penalty` on a DataProto, with a FixedKLController(beta) and
  kl_penalty "kl" (k1) or "low_var_kl" (k3), i.e. `core_algos.kl_penalty(old, ref) * response_mask` and
  `token_level_scores - beta * kld`; with beta 0 the trainer skips it (use_kl_in_reward false) and
  token_level_rewards are the scores. For k1, `core_algos.compute_rewards` as well (on masked
  log-probabilities: it does not mask);
- the advantages: `core_algos.compute_reinforce_plus_plus_outcome_advantage` (config = AlgoConfig(gamma)),
  `compute_reinforce_plus_plus_baseline_outcome_advantage` and `compute_rloo_outcome_advantage` (index =
  the uids, an object array of strings as the trainer keeps them), each also through the trainer's
  `ray_trainer.compute_advantage` (the registry, as the trainer calls it), which must give the same tensors.
Writes <out>.safetensors ("<case>/<name>") and <out>.json (versions and files).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
warnings.filterwarnings("ignore")  # "megatron engine is not available" and the like, on import

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import verl  # noqa: E402

if verl.__version__ != "0.9.1":
    raise SystemExit(f"expected verl 0.9.1 on PYTHONPATH, got {verl.__version__} from {verl.__file__}")

from safetensors.torch import load_file, save_file  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo import core_algos, ray_trainer  # noqa: E402

KL_PENALTY = {"k1": "kl", "k3": "low_var_kl"}  # our estimator names -> verl's algorithm.kl_penalty
ESTIMATORS = {
    "rppb": (core_algos.AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE, "reinforce_plus_plus_baseline"),
    "rloo": (core_algos.AdvantageEstimator.RLOO, "rloo"),
}


def token_level_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """verl/workers/reward_manager/naive.py: the score on the last valid response token."""
    reward_tensor = torch.zeros_like(response_mask, dtype=torch.float32)
    for i in range(scores.shape[0]):
        valid_response_length = response_mask[i].sum()
        reward_tensor[i, valid_response_length - 1] = scores[i]
    return reward_tensor


def trainer_advantage(rewards, mask, uid, estimator, gamma: float = 1.0):
    """ray_trainer.compute_advantage as the trainer calls it (config = the algorithm config)."""
    data = DataProto.from_dict(
        tensors=dict(token_level_rewards=rewards.clone(), response_mask=mask.clone()),
        non_tensors=dict(uid=uid),
    )
    config = AlgoConfig(gamma=gamma, adv_estimator=str(estimator.value))
    data = ray_trainer.compute_advantage(data, estimator, gamma=gamma, config=config)
    return data.batch["advantages"], data.batch["returns"]


def same(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if not torch.equal(a, b):
        raise SystemExit(f"{name}: the trainer path and the direct call disagree\n{a}\n{b}")


def run_case(case: dict, x: dict[str, torch.Tensor], gammas: list[float]) -> dict[str, torch.Tensor]:
    mask, scores = x["mask"], x["scores"]
    uid = np.array(case["uids"], dtype=object)
    scores_tok = token_level_scores(scores, mask)
    out = dict(token_level_scores=scores_tok)

    kl_name = KL_PENALTY[case["estimator"]]
    data = DataProto.from_dict(
        tensors=dict(
            response_mask=mask.clone(),
            token_level_scores=scores_tok.clone(),
            old_log_probs=x["logp"].clone(),
            ref_log_prob=x["ref"].clone(),
        ),
        non_tensors=dict(uid=uid),
    )
    data, _ = ray_trainer.apply_kl_penalty(data, core_algos.FixedKLController(kl_coef=case["beta"]), kl_penalty=kl_name)
    out["kl"] = core_algos.kl_penalty(x["logp"], x["ref"], kl_penalty=kl_name) * mask
    out["token_rewards_kl_in_reward"] = data.batch["token_level_rewards"]
    if case["estimator"] == "k1":
        out["token_rewards_compute_rewards"] = core_algos.compute_rewards(
            scores_tok, x["logp"] * mask, x["ref"] * mask, case["beta"]
        )
    # beta 0 means use_kl_in_reward false: the trainer takes the scores as they are
    rewards = out["token_rewards_kl_in_reward"] if case["beta"] else scores_tok
    out["token_rewards"] = rewards

    for gamma in gammas:
        adv, ret = core_algos.compute_reinforce_plus_plus_outcome_advantage(
            rewards.clone(), mask.clone(), config=AlgoConfig(gamma=gamma)
        )
        t_adv, t_ret = trainer_advantage(
            rewards, mask, uid, core_algos.AdvantageEstimator.REINFORCE_PLUS_PLUS, gamma=gamma
        )
        same(f"{case['name']} reinforce_plus_plus gamma {gamma}", adv, t_adv)
        same(f"{case['name']} reinforce_plus_plus gamma {gamma} returns", ret, t_ret)
        out[f"rpp_adv_g{gamma}"], out[f"rpp_ret_g{gamma}"] = adv, ret

    adv, ret = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards.clone(), mask.clone(), uid)
    out["rppb_adv"], out["rppb_ret"] = adv, ret
    adv, ret = core_algos.compute_rloo_outcome_advantage(rewards.clone(), mask.clone(), uid)
    out["rloo_adv"], out["rloo_ret"] = adv, ret
    for short, (estimator, registry_name) in ESTIMATORS.items():
        assert core_algos.get_adv_estimator_fn(registry_name) is core_algos.get_adv_estimator_fn(estimator)
        t_adv, t_ret = trainer_advantage(rewards, mask, uid, estimator)
        same(f"{case['name']} {registry_name}", out[f"{short}_adv"], t_adv)
        same(f"{case['name']} {registry_name} returns", out[f"{short}_ret"], t_ret)
    return out


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    inputs = load_file(spec["inputs"])
    results = {}
    # the k3 estimator far from the reference, where verl clamps (the log-ratio to +-20, the estimate to +-10)
    for name in ("k1", "k3"):
        results[f"extreme/{name}"] = core_algos.kl_penalty(
            inputs["extreme/logp"], inputs["extreme/ref"], KL_PENALTY[name]
        )
    for case in spec["cases"]:
        x = {key.split("/", 1)[1]: value for key, value in inputs.items() if key.split("/", 1)[0] == case["name"]}
        for name, tensor in run_case(case, x, spec["gammas"]).items():
            results[f"{case['name']}/{name}"] = tensor.detach().cpu().clone()  # (verl returns (scores, scores))
    save_file(results, spec["out"] + ".safetensors")
    meta = dict(
        verl_version=verl.__version__,
        verl_file=verl.__file__,
        core_algos_file=core_algos.__file__,
        transformers_version=transformers.__version__,
        transformers_file=transformers.__file__,
        torch_version=torch.__version__,
    )
    Path(spec["out"] + ".json").write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
