"""PromptBench adapter: the task metric and robustness under PromptBench's prompt perturbations.

The only module that imports promptbench.

* Accuracy is PromptBench's own ``Eval.compute_cls_accuracy``. Balanced accuracy, macro-F1 and ROC-AUC
  (one-vs-rest, macro, for more than two labels) are added because the risk data is imbalanced (a classifier
  that always says "low risk" has 88% accuracy). ``fit_threshold`` and ``fit_offsets`` fit the calibrated
  decision (two labels: a log-odds cut; more: an offset per label) on train data.
* Robustness runs PromptBench's own ``CheckListTransformation`` and ``StressTestTransformation`` (from
  ``promptbench/prompt_attack/transformations.py``) on the candidate template and reports PromptBench's
  Performance Drop Rate, ``PDR = 1 - metric(perturbed) / metric(clean)``.

PromptBench builds those transformations on TextAttack. TextAttack 0.3.11 cannot be imported next to
transformers 5 (its import chain goes through flair, which needs transformers 4), and the rest of
``promptbench.prompt_attack`` imports TextAttack's whole attack stack. So this module loads
``transformations.py`` by path, gives it TextAttack's ``Transformation`` base class as a bare stand-in
(the transformations only subclass it), and hands the transformations a ``PromptText`` with the two members
they call on TextAttack's ``AttackedText``: ``words`` (TextAttack's ``words_from_text`` rule) and
``insert_text_after_word_index``. The perturbation texts and where they go are PromptBench's code, run as is.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
import types
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np

# ---- metrics ------------------------------------------------------------------------------------


def accuracy(preds: Sequence[str], gold: Sequence[str]) -> float:
    """PromptBench's classification accuracy (case-insensitive string match)."""
    from promptbench.metrics import Eval

    if not preds:
        return float("nan")
    return float(Eval.compute_cls_accuracy(list(preds), list(gold)))


def balanced_accuracy(preds: Sequence[str], gold: Sequence[str], labels: Sequence[str]) -> float:
    recalls = []
    for label in labels:
        idx = [i for i, g in enumerate(gold) if g == label]
        if idx:
            recalls.append(sum(preds[i] == label for i in idx) / len(idx))
    return float(np.mean(recalls)) if recalls else float("nan")


def macro_f1(preds: Sequence[str], gold: Sequence[str], labels: Sequence[str]) -> float:
    scores = []
    for label in labels:
        tp = sum(p == label and g == label for p, g in zip(preds, gold))
        fp = sum(p == label and g != label for p, g in zip(preds, gold))
        fn = sum(p != label and g == label for p, g in zip(preds, gold))
        scores.append(0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn))
    return float(np.mean(scores)) if scores else float("nan")


def roc_auc(scores: Sequence[float], positive: Sequence[bool]) -> float:
    """Probability that a random positive scores above a random negative (ties count half)."""
    scores = np.asarray(scores, dtype=np.float64)
    positive = np.asarray(positive, dtype=bool)
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores), dtype=np.float64)
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):  # average ranks over ties
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def fit_threshold(log_odds: Sequence[float], positive: Sequence[bool]) -> float:
    """The log-odds cut that maximises balanced accuracy on calibration data (midpoint between scores)."""
    x = np.asarray(log_odds, dtype=np.float64)
    y = np.asarray(positive, dtype=bool)
    if y.all() or (~y).all():
        raise ValueError("calibration data needs examples of both labels")
    candidates = np.unique(x)
    cuts = np.concatenate([[candidates[0] - 1.0], (candidates[:-1] + candidates[1:]) / 2, [candidates[-1] + 1.0]])
    best, best_score = 0.0, -1.0
    for cut in cuts:
        pred = x > cut
        score = 0.5 * (pred[y].mean() + (~pred[~y]).mean())
        if score > best_score:
            best, best_score = float(cut), score
    return best


def label_log_odds(logprobs, k: int) -> np.ndarray:
    """Per row, log P(label k) - log P(any other label), from log-probs normalised over the labels."""
    logprobs = np.asarray(logprobs, dtype=np.float64)
    return logprobs[:, k] - np.logaddexp.reduce(np.delete(logprobs, k, axis=1), axis=1)


def roc_auc_ovr(logprobs, gold: Sequence[str], labels: Sequence[str]) -> float:
    """Macro one-vs-rest ROC-AUC: the mean over labels of the ROC-AUC of that label's log-odds against the rest
    (labels absent from ``gold`` are left out). With two labels both terms equal the binary ROC-AUC."""
    logprobs = np.asarray(logprobs, dtype=np.float64)
    values = [roc_auc(label_log_odds(logprobs, k), [g == label for g in gold]) for k, label in enumerate(labels)]
    values = [v for v in values if not math.isnan(v)]
    return float(np.mean(values)) if values else float("nan")


def _balanced_accuracy_idx(pred: np.ndarray, y: np.ndarray, n_labels: int) -> float:
    recalls = [(pred[y == k] == k).mean() for k in range(n_labels) if (y == k).any()]
    return float(np.mean(recalls))


def fit_offsets(logprobs, gold: Sequence[str], labels: Sequence[str], rounds: int = 4) -> np.ndarray:
    """Per-label offsets for ``argmax(logprobs + offsets)`` that maximise balanced accuracy on calibration data:
    the many-label form of ``fit_threshold``. Starts from the prior correction (minus each label's mean log-prob),
    then coordinate ascent: for each label in turn, every offset at which some example changes its decision is
    tried (midpoints), and the best is kept (the nearest to the current value on ties). Offsets sum to zero."""
    x = np.asarray(logprobs, dtype=np.float64)
    index = {label: k for k, label in enumerate(labels)}
    y = np.array([index.get(g, -1) for g in gold])
    n = len(labels)
    if x.ndim != 2 or x.shape[1] != n or len(y) != len(x) or (y < 0).any():
        raise ValueError(f"expected one row of {n} log-probs and one known label per calibration example")
    if len(set(y.tolist())) < 2:
        raise ValueError("calibration data needs examples of at least two labels")
    offsets = -x.mean(axis=0)
    best_score = _balanced_accuracy_idx((x + offsets).argmax(axis=1), y, n)
    for _ in range(rounds):
        improved = False
        for k in range(n):
            shifted = x + offsets
            # example i goes to label k exactly when offset_k > (best other score) - logprob_ik
            others = np.delete(shifted, k, axis=1).max(axis=1)
            flips = np.unique(others - x[:, k])
            cuts = np.concatenate([[flips[0] - 1.0], (flips[:-1] + flips[1:]) / 2, [flips[-1] + 1.0]])
            current = offsets[k]
            choice, choice_score = current, best_score
            for cut in cuts:
                trial = offsets.copy()
                trial[k] = cut
                score = _balanced_accuracy_idx((x + trial).argmax(axis=1), y, n)
                better = score > choice_score + 1e-12
                as_good_nearer = score > best_score + 1e-12 and abs(score - choice_score) <= 1e-12 and (
                    abs(cut - current) < abs(choice - current))
                if better or as_good_nearer:
                    choice, choice_score = float(cut), score
            if choice_score > best_score + 1e-12:
                improved = True
                offsets[k], best_score = choice, choice_score
        if not improved:
            break
    return offsets - offsets.mean()


def classification_metrics(
    preds: Sequence[str], gold: Sequence[str], labels: Sequence[str], logprobs=None
) -> dict[str, float]:
    """Accuracy (PromptBench's), balanced accuracy and macro-F1 of the decided labels (None: a broken answer,
    wrong), and, with the label log-probs, the macro one-vs-rest ROC-AUC (the binary ROC-AUC for two labels)."""
    out = {
        "accuracy": accuracy(preds, gold),
        "balanced_accuracy": balanced_accuracy(preds, gold, labels),
        "macro_f1": macro_f1(preds, gold, labels),
    }
    if logprobs is not None:
        out["roc_auc"] = roc_auc_ovr(logprobs, gold, labels)
    return out


def performance_drop_rate(clean: float, perturbed: float) -> float:
    """PromptBench's PDR: the fraction of the clean metric lost under the perturbation."""
    if not clean or math.isnan(clean) or math.isnan(perturbed):
        return float("nan")
    return 1.0 - perturbed / clean


# ---- perturbations ------------------------------------------------------------------------------

_WORD = re.compile(r"[\w'\-_\*@]+")
_EDGES = "'-_*@"


class PromptText:
    """The part of TextAttack's ``AttackedText`` that PromptBench's checklist/stresstest transformations use."""

    def __init__(self, text: str):
        self.text = text
        self._spans = []  # (start, end) of each word, TextAttack's words_from_text rule
        for match in _WORD.finditer(text):
            word = match.group(0)
            left = len(word) - len(word.lstrip(_EDGES))
            right = len(word) - len(word.rstrip(_EDGES))
            if len(word) - left - right > 0:
                self._spans.append((match.start() + left, match.end() - right))
        self.words = [text[a:b] for a, b in self._spans]

    def insert_text_after_word_index(self, index: int, text: str) -> "PromptText":
        end = self._spans[index][1]
        return PromptText(self.text[:end] + " " + text + self.text[end:])


@lru_cache(maxsize=1)
def _transformations_module():
    import promptbench  # noqa: F401  (the package must be installed; see scripts/setup.sh)

    if importlib.util.find_spec("textattack") is None and "textattack.transformations" not in sys.modules:
        base = types.ModuleType("textattack.transformations")
        base.Transformation = type("Transformation", (), {"__doc__": "stand-in for TextAttack's base class"})
        sys.modules.setdefault("textattack", types.ModuleType("textattack"))
        sys.modules["textattack.transformations"] = base
    path = Path(importlib.util.find_spec("promptbench").submodule_search_locations[0]) / "prompt_attack" / "transformations.py"
    spec = importlib.util.spec_from_file_location("promptbench_prompt_transformations", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ATTACKS = ("checklist", "stresstest")


def perturb(template_text: str, attack: str) -> list[str]:
    """All variants of ``template_text`` that PromptBench's ``attack`` transformation produces."""
    module = _transformations_module()
    cls = {"checklist": module.CheckListTransformation, "stresstest": module.StressTestTransformation}.get(attack)
    if cls is None:
        raise ValueError(f"unknown perturbation {attack!r}; use one of {ATTACKS}")
    prompt = PromptText(template_text)
    if not prompt.words:
        return []
    return [t.text for t in cls()._get_transformations(prompt, None)]
