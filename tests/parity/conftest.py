"""Fixtures of the TRL parity tests.

PPO (test_trl_ppo_*.py, helpers in trl_ppo_common.py): `world` runs TRL 1.12's side once per session and
loads what it recorded; `report_max_diffs` (requested by those modules and test_verl_estimators.py through
`pytestmark`) prints the largest difference each comparison reached in the module (max_diffs.py).
GRPO (test_trl_grpo_*.py, helpers in trl_grpo_common.py): `tokenizer` and `make_trainer`, a factory of real
`trl.GRPOTrainer`s around a tiny seeded Llama. The reward model's parity test (test_trl_reward_parity.py) uses
the same `tokenizer`.
RLOO (test_trl_rloo.py, helpers in trl_rloo_common.py): `make_rloo_trainer`, a factory of real
`trl.RLOOTrainer`s around the same Llama (with beta > 0, TRL loads its reference model from a local directory).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.parity.max_diffs import MAX_DIFFS, max_diffs_report
from tests.parity.trl_grpo_common import MAX_COMPLETION, build_policy, named_reward
from tests.parity.trl_grpo_common import build_tokenizer as build_grpo_tokenizer
from tests.parity.trl_ppo_common import (
    BATCH,
    EOS,
    KL_COEF,
    MISSING,
    PAD,
    REPO,
    RUNS,
    SETTINGS,
    WORKER,
    build_models,
    build_tokenizer,
    make_prompts,
    make_responses,
    trl112_dir,
)

# ------------------------------------------------------------------------------------------------- PPO


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    """Save the models and tokenizers, run TRL 1.12's side once for every run, load what it recorded."""
    trl_dir = trl112_dir()
    if trl_dir is None:
        pytest.fail(MISSING, pytrace=False)
    tmp = tmp_path_factory.mktemp("trl112_ppo")
    models = build_models()
    model_dirs = {}
    for name, model in models.items():
        model.save_pretrained(tmp / name)
        model_dirs[name] = str(tmp / name)
    for pad_is_eos in (False, True):
        build_tokenizer(pad_is_eos).save_pretrained(tmp / f"tokenizer_pad_is_eos_{pad_is_eos}")

    prompts = make_prompts()
    runs, meta = [], {}
    for name, (pad_is_eos, stops, seed, estimator, whiten, penalty) in RUNS.items():
        pad = EOS if pad_is_eos else PAD
        ppo = dict(
            SETTINGS,
            kl_coef=KL_COEF[estimator],
            kl_estimator=estimator,
            whiten_rewards=whiten,
            missing_eos_penalty=penalty,
        )
        runs.append(
            dict(
                name=name,
                tokenizer_dir=str(tmp / f"tokenizer_pad_is_eos_{pad_is_eos}"),
                prompts=prompts,
                responses=make_responses(stops, pad, seed),
                ppo=ppo,
                seed=seed,
            )
        )
        meta[name] = dict(pad=pad, stops=stops, ppo=ppo)
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"models": model_dirs, "runs": runs, "out_dir": str(tmp / "out")}))

    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        TRL_EXPERIMENTAL_SILENCE="1",
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=os.pathsep.join([str(trl_dir), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(spec)], env=env, cwd=REPO, capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        pytest.fail(
            f"the TRL 1.12 side failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}",
            pytrace=False,
        )
    print(f"\nTRL 1.12 side: {len(runs)} runs in {time.perf_counter() - start:.1f} s")
    results = {}
    for name, run in zip(RUNS, runs):
        tensors = load_file(str(tmp / "out" / f"{name}.safetensors"))
        order = torch.argsort(tensors["prompt_index"])  # TRL's dataloader shuffles: rows in prompt order
        assert torch.equal(tensors["prompt_index"][order], torch.arange(BATCH)), tensors["prompt_index"]
        tensors = {k: v[order] if v.dim() and v.shape[0] == BATCH else v for k, v in tensors.items()}
        assert torch.equal(tensors["frame_responses"], torch.tensor(run["responses"])), name
        results[name] = dict(
            tensors,
            meta=json.loads((tmp / "out" / f"{name}.json").read_text()),
            responses=run["responses"],
            **meta[name],
        )
    return models, results


@pytest.fixture(scope="module")
def report_max_diffs():
    """Print the largest difference reached by each comparison (shown with -s or -rA)."""
    MAX_DIFFS.clear()  # this module's comparisons only
    yield
    if MAX_DIFFS:
        print(max_diffs_report())


# ------------------------------------------------------------------------------------------------ GRPO


@pytest.fixture(scope="module")
def tokenizer():
    return build_grpo_tokenizer()


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


# ------------------------------------------------------------------------------------------------ RLOO


@pytest.fixture(scope="module")
def make_rloo_trainer(tokenizer, tmp_path_factory):
    """make_rloo_trainer(temperature=, reward_names=, model=, beta=, **RLOOConfig fields) -> a real trl.RLOOTrainer.

    beta defaults to 0 (TRL's RLOO default is 0.05). With beta > 0 and no `model`, the policy is
    `trained_policy` (trl_rloo_common.py): TRL loads its reference model itself, offline, from the directory
    the policy was loaded from (the untrained seed-0 policy), so the policy and the reference differ.
    """
    from datasets import Dataset
    from trl import RLOOConfig, RLOOTrainer

    from tests.parity.trl_rloo_common import save_reference, trained_policy

    dataset = Dataset.from_dict({"prompt": ["w3 w4 w5", "w6 w7 w8", "w9 w10 w11", "w12 w13 w14"]})
    reference_dir = []

    def make(temperature: float = 1.0, reward_names=("r0",), model=None, beta: float = 0.0, **overrides):
        if model is None:
            if beta:
                if not reference_dir:
                    reference_dir.append(save_reference(tmp_path_factory.mktemp("trl_rloo_reference")))
                model = trained_policy(reference_dir[0])
            else:
                model = build_policy()
        args = RLOOConfig(
            output_dir=str(tmp_path_factory.mktemp("trl_rloo")),
            use_cpu=True,
            bf16=False,
            report_to=[],
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=MAX_COMPLETION,
            temperature=temperature,
            beta=beta,
            gradient_checkpointing=False,
            save_strategy="no",
            logging_steps=1,
            **overrides,
        )
        trainer = RLOOTrainer(
            model=model,
            args=args,
            reward_funcs=[named_reward(n) for n in reward_names],
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        trainer.model.train()  # `mode` is "train" in TRL's code paths
        assert (trainer.ref_model is not None) == bool(beta)
        return trainer

    return make
