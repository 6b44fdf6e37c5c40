"""``--rm-type f1``: SQuAD-style token F1 between the response and the label (a float in [0, 1]).

Both sides are lower-cased, stripped of punctuation and of the articles a/an/the, and split on
whitespace. When either side normalises to ``yes``, ``no`` or ``noanswer`` the other must be the same
word, else the score is 0.
"""

from __future__ import annotations

import re
import string
from collections import Counter

_PUNCT = str.maketrans("", "", string.punctuation)
_YES_NO = ("yes", "no", "noanswer")


def normalize_answer(text: str) -> str:
    text = text.lower().translate(_PUNCT)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_parts(prediction: str | None, truth: str) -> tuple[float, float, float]:
    """(f1, precision, recall)."""
    if prediction is None:
        return 0.0, 0.0, 0.0
    pred, gold = normalize_answer(prediction), normalize_answer(str(truth))
    if (pred in _YES_NO or gold in _YES_NO) and pred != gold:
        return 0.0, 0.0, 0.0
    pred_tokens, gold_tokens = pred.split(), gold.split()
    same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if same == 0:
        return 0.0, 0.0, 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall), precision, recall


def f1_reward(response: str, label: str) -> float:
    return f1_parts(response, label)[0]


f1_score = f1_parts  # Miles's name: f1_score(prediction, ground_truth) -> (f1, precision, recall)
