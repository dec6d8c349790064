"""Evaluation with a verifier (RLVR): several sampled completions per prompt, each correct or not, summarized
per prompt as the unbiased pass@k of Chen et al. (arXiv:2107.03374) and majority-vote accuracy (maj@n).

pass@k = 1 - C(n - c, k) / C(n, k) for c correct of n samples: the chance that at least one of k samples
drawn without replacement from the n is correct (unbiased, unlike 1 - (1 - c/n)^k). maj@n: whether the
most frequent answer of the n (their completions stripped of surrounding whitespace; ties go to the answer
seen first) is correct.
"""

from __future__ import annotations

from collections import Counter
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from c correct of n samples (k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 if n - c < k else 1.0 - comb(n - c, k) / comb(n, k)


def majority_correct(completions: list[str], correct: list[float]) -> float:
    """1.0 when the most frequent completion (stripped; ties to the first seen) is a correct one, else 0.0."""
    answers = [str(c).strip() for c in completions]
    counts = Counter(answers)
    top = max(counts.values())
    winner = next(a for a in answers if counts[a] == top)
    return float(correct[answers.index(winner)] >= 1.0)


def sampled_columns(rows: list[dict], n: int, verifier: str, ks: list[int]) -> list[dict]:
    """Per prompt, from its n consecutive sampled rows (each with the verifier's 0/1 column):
    {pass_at_<k>: ..., maj_at_<n>: ...}. A row the verifier left None counts as wrong."""
    if len(rows) % n:
        raise ValueError(f"{len(rows)} sampled rows are not {n} per prompt")
    out = []
    for start in range(0, len(rows), n):
        group = rows[start : start + n]
        correct = [float(r.get(verifier) or 0.0) for r in group]
        c = sum(v >= 1.0 for v in correct)
        columns = {f"pass_at_{k}": pass_at_k(n, c, k) for k in ks}
        columns[f"maj_at_{n}"] = majority_correct([r["completion"] for r in group], correct)
        out.append(columns)
    return out
