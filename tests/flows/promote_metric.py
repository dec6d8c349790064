"""A metric for the promotion tests: 1.0 where a completion equals the target the test wrote for its prompt."""

import json
import os
from pathlib import Path


def agreement(prompts, completions, **_):
    """Conversational prompts (the demo's): prompts are message lists and completions assistant turns."""
    targets = json.loads(Path(os.environ["RLHF_TEST_TARGETS"]).read_text())
    return [1.0 if targets.get(p[-1]["content"]) == c[0]["content"] else 0.0 for p, c in zip(prompts, completions)]
