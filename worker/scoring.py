"""Scoring a prompt (``prompt_logprobs``): each prompt token's log-probability under the rows
before it, with the best alternatives, as evaluation harnesses ask for."""

from __future__ import annotations

import numpy as np

from shared.protocol import PromptLogprob, TopLogprob

MAX_PROMPT_ALTERNATIVES = 20  # alternatives per scored prompt token, as for generated ones


def score_rows(rows: np.ndarray, prompt: list[int], start: int, alternatives: int) -> list[PromptLogprob]:
    """``[logprob, [[id, logprob], …]]`` of each prompt token that a row of ``rows`` predicts:
    row j holds the logits after prompt position ``start + j``. The last row of the prompt
    predicts the first generated token, so it scores nothing."""
    scores = []
    for j in range(len(rows)):
        target = start + j + 1
        if target >= len(prompt):
            break
        # one row at a time in float64: a chunk's whole [T, vocab] would be gigabytes
        wide = rows[j].astype(np.float64)
        peak = wide.max()
        row = wide - (peak + np.log(np.exp(wide - peak).sum()))
        top = np.argpartition(-row, alternatives)[:alternatives] if alternatives else np.zeros(0, dtype=np.int64)
        top = top[np.argsort(-row[top], kind="stable")]
        scores.append(PromptLogprob(float(row[prompt[target]]), [TopLogprob(int(i), float(row[i])) for i in top]))
    return scores
