"""verl 0.9.1 parity of the REINFORCE++ / RLOO math: inputs, our side, and the oracle's subprocess.

verl 0.9.1 lives apart from the venv, in .venv/verl-0.9.1 (`make venv`: --no-deps --target, with the few
packages its imports need that the venv lacks), and runs only in a subprocess (tests/parity/verl_side.py)
whose PYTHONPATH starts with that directory; the test process never imports it. See test_verl_estimators.py
for what is compared.

Each case is a batch of `groups` prompts x `group` responses of unequal lengths (right-padded masks, one row
of length 1 and one of full length), float32 on the CPU, with a score per response and policy / reference
log-probabilities per token (garbage on padding: both sides must mask it). `lone` cases keep one response of
the last prompt: verl gets only the rows kept (a prompt with one response); we get the whole batch with the
dropped rows unscorable (NaN / `scorable` False, mask 0), which is how our pipeline carries them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlhf_core.rl.advantages.group_baselines import reinforce_pp_advantages, rloo_advantages
from rlhf_core.rl_math import kl_penalized_rewards, kl_per_token
from tests.parity.max_diffs import record_max_diff

REPO = Path(__file__).resolve().parents[2]
SIDE = Path(__file__).with_name("verl_side.py")
VERL_VERSION = "0.9.1"

VERL_CANDIDATES = tuple(dict.fromkeys([Path(sys.executable).parents[1] / "verl-0.9.1", REPO / ".venv" / "verl-0.9.1"]))
MISSING = (
    "verl 0.9.1 is not installed apart: expected "
    + " or ".join(str(c) for c in VERL_CANDIDATES)
    + " to hold verl/trainer/ppo/core_algos.py. Run `make venv` (touch pyproject.toml first if .venv is"
    " up to date), or: .venv/bin/python -m pip install --no-deps --target .venv/verl-0.9.1 verl==0.9.1"
    " omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 tensordict==0.10.0 pyvers==0.1.0 codetiming==1.4.0"
    " torchdata==0.11.0"
)

ATOL = 1e-6  # float32; the same math on the same inputs agrees to ~1e-7
RTOL_LARGE = 1e-5  # relative, for the case whose scores (and so raw advantages and returns) are ~100
GAMMAS = (1.0, 0.9)
WIDTH = 8  # response tokens


def verl_dir() -> Path | None:
    for candidate in VERL_CANDIDATES:
        if (candidate / "verl" / "trainer" / "ppo" / "core_algos.py").is_file():
            return candidate
    return None


@dataclass(frozen=True)
class Case:
    name: str
    group: int  # responses per prompt (num_generations)
    groups: int  # prompts
    beta: float  # KL-in-reward coefficient (verl: algorithm.kl_ctrl.kl_coef with use_kl_in_reward)
    estimator: str = "k1"  # k1 ("kl" in verl) or k3 ("low_var_kl" in verl)
    scale: float = 1.0  # scores ~ N(0, scale^2)
    lone: bool = False  # the last prompt keeps one response
    seed: int = 0

    @property
    def rows(self) -> int:
        return self.group * self.groups

    @property
    def rtol(self) -> float:
        return RTOL_LARGE if self.scale > 10 else 0.0


CASES = (
    Case("n4_beta0", 4, 3, 0.0, seed=1),
    Case("n3_beta0", 3, 4, 0.0, seed=2),
    Case("n4_k1", 4, 3, 0.2, "k1", seed=3),
    Case("n3_k1", 3, 4, 0.2, "k1", seed=4),
    Case("n4_k3", 4, 3, 0.2, "k3", seed=5),
    Case("n3_k3", 3, 4, 0.2, "k3", seed=6),
    Case("n4_k1_large", 4, 3, 0.2, "k1", scale=100.0, seed=7),
    Case("n4_k1_lone", 4, 3, 0.2, "k1", lone=True, seed=8),
    Case("n3_beta0_lone", 3, 4, 0.0, lone=True, seed=9),
)
LONE_CASES = tuple(c for c in CASES if c.lone)


def make_inputs(case: Case) -> dict[str, torch.Tensor]:
    """The batch of a case (all rows): lengths, mask (long, as verl's attention mask), last index, scores,
    log-probabilities, and `keep` (False on the rows a lone case drops)."""
    g = torch.Generator().manual_seed(1000 + case.seed)
    rows = case.rows
    lengths = torch.randint(1, WIDTH + 1, (rows,), generator=g)
    lengths[0], lengths[1] = WIDTH, 1  # a row that runs to the end and one of a single token
    positions = torch.arange(WIDTH).view(1, -1)
    mask = (positions < lengths.view(-1, 1)).long()
    scores = torch.randn(rows, generator=g) * case.scale
    scores[case.group + 1] = scores[case.group]  # a tie inside a group
    logp = -(torch.rand(rows, WIDTH, generator=g) * 3 + 0.05)
    ref = logp + 0.4 * torch.randn(rows, WIDTH, generator=g)
    # padding: what a real batch may hold there (our INVALID_LOGPROB on one side, anything on the other)
    logp = torch.where(mask.bool(), logp, torch.ones_like(logp))
    ref = torch.where(mask.bool(), ref, torch.randn(rows, WIDTH, generator=g) * 3)
    keep = torch.ones(rows, dtype=torch.bool)
    if case.lone:
        keep[rows - case.group + 1 :] = False
    return dict(
        lengths=lengths,
        mask=mask,
        last_index=lengths - 1,
        scores=scores.float(),
        logp=logp.float(),
        ref=ref.float(),
        keep=keep,
    )


def extreme_logprobs() -> dict[str, torch.Tensor]:
    """Log-ratios x = log pi - log ref from -30 to 30 (1, 61): k3 = e^-x - 1 + x passes 10 near x = -2.61 and 11."""
    logp = torch.full((1, 61), -40.0)
    return dict(logp=logp, ref=logp - torch.linspace(-30, 30, 61).view(1, -1))


def uids(case: Case) -> list[str]:
    """verl's `index`: the prompt's uid on each row (a uuid4 string in verl's trainer)."""
    return [f"{case.name}-prompt-{i // case.group}" for i in range(case.rows)]


# -------------------------------------------------------------------------------------------- our side


def our_side(case: Case, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our math on the whole batch; the rows a lone case drops are unscorable and masked out."""
    keep = x["keep"]
    mask = x["mask"] * keep.view(-1, 1).long()
    kl = kl_per_token(x["logp"], x["ref"], case.estimator) * mask
    token_rewards, _ = kl_penalized_rewards(x["scores"], kl, mask, x["last_index"], case.beta)
    token_rewards = token_rewards * mask  # a dropped row's score sits on its (masked-out) last token otherwise
    out = dict(kl=kl, token_rewards=token_rewards)
    for gamma in GAMMAS:
        adv, ret = reinforce_pp_advantages(token_rewards, mask, gamma=gamma)
        out[f"rpp_adv_g{gamma}"], out[f"rpp_ret_g{gamma}"] = adv, ret
    adv, ret = reinforce_pp_advantages(token_rewards, mask, num_generations=case.group, scorable=keep)
    out["rppb_adv"], out["rppb_ret"] = adv, ret
    per_source = x["scores"].masked_fill(~keep, float("nan")).view(-1, 1)
    rloo = rloo_advantages(per_source, torch.ones(1), case.group, kl=kl.sum(-1), beta=case.beta)
    out["rloo_adv"] = rloo.advantages.view(-1, 1) * mask  # verl's is broadcast over the mask
    return out


# ------------------------------------------------------------------------------------------ verl's side


def run_verl(tmp: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """Run verl_side.py once for every case; -> ({case or "extreme": {name: tensor}}, meta). Raises
    RuntimeError with the subprocess's output if it fails. Only the rows kept go to verl."""
    home = verl_dir()
    assert home is not None, MISSING
    inputs = {}
    cases = []
    for case in CASES:
        x = make_inputs(case)
        keep = x["keep"]
        for key in ("mask", "scores", "logp", "ref"):
            inputs[f"{case.name}/{key}"] = x[key][keep].contiguous()
        cases.append(dict(asdict(case), uids=[u for u, k in zip(uids(case), keep.tolist()) if k]))
    inputs.update({f"extreme/{key}": value for key, value in extreme_logprobs().items()})
    save_file(inputs, str(tmp / "inputs.safetensors"))
    spec = dict(inputs=str(tmp / "inputs.safetensors"), out=str(tmp / "verl"), gammas=list(GAMMAS), cases=cases)
    (tmp / "spec.json").write_text(json.dumps(spec))
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(home), *filter(None, [os.environ.get("PYTHONPATH")])]),
        CUDA_VISIBLE_DEVICES="",
        VERL_USE_EXTERNAL_PLUGINS="none",  # no entry-point plugins from the venv
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    proc = subprocess.run(
        [sys.executable, str(SIDE), str(tmp / "spec.json")],
        env=env,
        cwd=tmp,  # not the repo: nothing of ours is importable from the working directory
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"the verl side failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    tensors = load_file(str(tmp / "verl.safetensors"))
    out: dict[str, dict[str, torch.Tensor]] = {case.name: {} for case in CASES} | {"extreme": {}}
    for key, value in tensors.items():
        name, field = key.split("/", 1)
        out[name][field] = value
    return out, json.loads((tmp / "verl.json").read_text())


def close(name: str, ours: torch.Tensor, theirs: torch.Tensor, atol: float = ATOL, rtol: float = 0.0) -> None:
    """|ours - verl| <= atol + rtol * |verl| everywhere (float64 for the check)."""
    assert ours.shape == theirs.shape, f"{name}: shapes {tuple(ours.shape)} vs {tuple(theirs.shape)}"
    ours, theirs = ours.double(), theirs.double()
    diff = (ours - theirs).abs()
    record_max_diff(name, diff.max().item() if diff.numel() else 0.0)
    bad = diff > atol + rtol * theirs.abs()
    assert not bad.any(), (
        f"{name}: {int(bad.sum())} entries off, max abs diff {diff.max().item():.3g} (atol {atol:g}, rtol {rtol:g})"
        f"\nours:\n{ours}\nverl {VERL_VERSION}:\n{theirs}"
    )
