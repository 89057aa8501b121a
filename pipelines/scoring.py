"""Scoring candidate templates: validity, the target model's metric, robustness, the judge, length, latency.

``CandidateScorer`` holds one target model (and the judge, by default the same model, so no extra memory)
and turns candidate template texts into ``Measured`` records, which ``rewards.weighting.weigh`` turns into
rewards. It runs in-process; ``pipelines/ray_scoring.py`` runs copies of it in Ray actors.

Two modes:
* ``measure`` (the tuning loop): the dev split, the reward metric (ROC-AUC by default, threshold-free),
  robustness on a dev sample, the judge. No calibration pass.
* ``evaluate`` (``tune-prompts eval``, final tables, the promotion gate): any split, the decision rule of the
  task (a threshold fitted on train examples, or argmax), every metric, per-request latency and render time.
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from pipelines.config import TaskConfig
from pipelines.data import Example, Splits
from pipelines.engine.models import LoadedLM
from pipelines.engine.target import LabelScorer, prompt_frame
from rewards import promptbench_metrics as pbm
from rewards.components import Measured, components_for
from rewards.judge import JUDGE_VERBALIZERS, Judge
from rewards.weighting import Reward, check_weights, weigh
from templates.template import Template, validate_candidate


@dataclass
class Evaluation:
    """Everything ``evaluate`` measured for one template on one split."""

    measured: Measured
    reward: Reward
    split: str
    n_examples: int
    threshold: float | None
    latency_ms: dict[str, float] = field(default_factory=dict)  # p50/p95 of one request, one at a time
    render_us_p99: float | None = None


def _reward_chance(task: TaskConfig) -> float:
    return 0.5 if task.scoring.reward_metric == "roc_auc" else 1.0 / len(task.labels)


def _prebuilt(scorer, verbalizers: list[str], role: str):
    """A label scorer passed in ready-made: it must answer with the words this role reads."""
    if not callable(getattr(scorer, "score", None)):
        raise TypeError(f"the {role} must be a LoadedLM or a label scorer with score(template, texts), not {scorer!r}")
    if list(scorer.verbalizers) != verbalizers:
        raise ValueError(f"the {role} scorer answers {list(scorer.verbalizers)}; it must answer {verbalizers}")
    return scorer


class CandidateScorer:
    def __init__(self, task: TaskConfig, splits: Splits, target, judge_lm=None, *, reward_examples: int | None = None):
        """``reward_examples``: how many dev examples (from the start of the split) ``measure`` scores by
        default; None: all of them. ``target`` and ``judge_lm``: a ``LoadedLM`` (scored in-process by ``LabelScorer``) or a prebuilt
        label scorer, anything with ``score(template, texts)`` and ``verbalizers`` (e.g. an
        ``EndpointLabelScorer`` from ``pipelines.engine.endpoints.make_label_scorer``). A prebuilt target scorer must
        use the task's verbalizers in label order; a prebuilt judge scorer, ``JUDGE_VERBALIZERS``."""
        # Weights and reward functions must match before any model work starts.
        self.components = components_for(task.judge.rubrics)
        check_weights(task.reward.weights, self.components)
        self.task = task
        self.splits = splits
        self.labels = list(task.labels)
        self.positive = self.labels.index(task.positive_label)
        cfg = task.scoring
        verbalizers = [task.labels[name].verbalizer for name in self.labels]
        if isinstance(target, LoadedLM):
            self.target = LabelScorer(target, verbalizers, chat_template=task.template.chat_template,
                                      batch_size=cfg.batch_size)
        else:
            self.target = _prebuilt(target, verbalizers, "target")
        judge_lm = judge_lm or target
        if judge_lm is target and self.target.verbalizers == list(JUDGE_VERBALIZERS):
            self.judge_scorer = self.target  # same model, same answer words: share the scorer and its cache
        elif isinstance(judge_lm, LoadedLM):
            self.judge_scorer = LabelScorer(judge_lm, list(JUDGE_VERBALIZERS), batch_size=cfg.batch_size)
        elif judge_lm is target:
            raise ValueError(f"the target scorer answers {self.target.verbalizers}, the judge needs "
                             f"{list(JUDGE_VERBALIZERS)}: pass a judge scorer built with JUDGE_VERBALIZERS")
        else:
            self.judge_scorer = _prebuilt(judge_lm, list(JUDGE_VERBALIZERS), "judge")
        self.judge = Judge(task.judge.rubrics, self.judge_scorer.score, task.judge.max_errors)
        if isinstance(target, LoadedLM):
            self.tokenizer = target.tokenizer
        else:  # a server owns the target model: count template tokens with the embedded model's tokenizer
            from pipelines.engine.models import load_tokenizer

            self.tokenizer = load_tokenizer()
        self.dev = list(splits.dev)[:reward_examples] if reward_examples else list(splits.dev)
        rng = random.Random(task.split.seed)
        self.robust_sample = rng.sample(self.dev, min(cfg.robustness_examples, len(self.dev)))
        self.calibration = list(splits.train)[: cfg.calibration_examples]

    # --- pieces --------------------------------------------------------------------------------
    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    def validate(self, text: str):
        return validate_candidate(text, (self.task.input_variable,), self.task.template.max_tokens, self.count_tokens)

    def log_odds(self, template: Template, examples: Sequence[Example]) -> np.ndarray:
        """Positive-label log-odds per example (log P(positive) - log P(not positive), over the labels)."""
        lp = self.target.score(template, [e.text for e in examples])
        others = np.delete(lp, self.positive, axis=1)
        return lp[:, self.positive] - np.logaddexp.reduce(others, axis=1)

    def _reward_metric(self, log_odds: np.ndarray, examples: Sequence[Example]) -> float:
        return pbm.roc_auc(log_odds, [e.label == self.task.positive_label for e in examples])

    def robustness_pdr(self, template: Template) -> dict[str, float]:
        """PDR per PromptBench attack on a dev sample, one perturbed variant per attack chosen by the
        template's hash (PromptBench's attacks search all variants for the worst; that costs 53x more)."""
        sample = self.robust_sample
        clean_metric = self._reward_metric(self.log_odds(template, sample), sample)  # cached after measure()
        out = {}
        seed = int(hashlib.sha256(template.text.encode()).hexdigest()[:8], 16)
        for attack in self.task.scoring.robustness_attacks:
            variants = pbm.perturb(template.text, attack)
            if not variants:
                continue
            variant = variants[seed % len(variants)]
            check = self.validate(variant)
            # A perturbation that breaks the template (e.g. text inserted into a trailing placeholder)
            # loses everything the template had: the metric falls to chance.
            metric = (
                self._reward_metric(self.log_odds(check.template, sample), sample)
                if check.ok
                else _reward_chance(self.task)
            )
            out[attack] = pbm.performance_drop_rate(clean_metric, metric)
        return out

    # --- the tuning loop's entry point --------------------------------------------------------------
    def measure(self, texts: Sequence[str], *, robustness: bool = True, whole_dev: bool = False) -> list[Measured]:
        """Measure candidate template texts on the dev sample, or on the whole dev split with ``whole_dev``
        (invalid ones are marked, not raised). Robustness always uses the same small dev sample."""
        cfg = self.task
        dev = list(self.splits.dev) if whole_dev else self.dev
        results: list[Measured | None] = [None] * len(texts)
        valid: list[tuple[int, Template, int]] = []
        for i, text in enumerate(texts):
            check = self.validate(text)
            if not check.ok:
                results[i] = Measured(template=text, valid=False, reasons=check.reasons, tokens=check.tokens,
                                      max_tokens=cfg.template.max_tokens, reward_metric=cfg.scoring.reward_metric)
            else:
                valid.append((i, check.template, check.tokens))
        t0 = time.perf_counter()
        judged = self.judge([t.text for _, t, _ in valid]) if valid else []
        judge_s = (time.perf_counter() - t0) / max(1, len(valid))
        for (i, template, tokens), judge in zip(valid, judged):
            t0 = time.perf_counter()
            odds = self.log_odds(template, dev)
            metric = self._reward_metric(odds, dev)
            t1 = time.perf_counter()
            pdr = self.robustness_pdr(template) if robustness else {}
            t2 = time.perf_counter()
            results[i] = Measured(
                template=template.text, valid=True, tokens=tokens, max_tokens=cfg.template.max_tokens,
                metrics={cfg.scoring.reward_metric: metric}, reward_metric=cfg.scoring.reward_metric,
                chance=_reward_chance(cfg), pdr=pdr, judge=judge,
                timing={"target_s": t1 - t0, "robustness_s": t2 - t1, "judge_s": judge_s},
            )
        return results  # type: ignore[return-value]

    def reward(self, m: Measured) -> Reward:
        return weigh(m, self.task.reward.weights, self.components, self.task.reward.invalid_penalty)

    # --- full evaluation ---------------------------------------------------------------------------
    def fit_threshold(self, template: Template) -> float | None:
        if self.task.scoring.decision != "threshold":
            return None
        odds = self.log_odds(template, self.calibration)
        return pbm.fit_threshold(odds, [e.label == self.task.positive_label for e in self.calibration])

    def predict(self, template: Template, examples: Sequence[Example], threshold: float | None):
        lp = self.target.score(template, [e.text for e in examples])
        others = np.delete(lp, self.positive, axis=1)
        odds = lp[:, self.positive] - np.logaddexp.reduce(others, axis=1)
        if threshold is None:
            preds = [self.labels[j] for j in lp.argmax(axis=1)]
        else:
            negative = [label for label in self.labels if label != self.task.positive_label][0]
            preds = [self.task.positive_label if o > threshold else negative for o in odds]
        return preds, odds

    def request_latency_ms(self, template: Template, examples: Sequence[Example], n: int = 12) -> dict[str, float]:
        """What a service sees: one request at a time, the whole prompt, no cache."""
        if not isinstance(self.target, LabelScorer):  # an endpoint times its own requests
            return self.target.request_latency_ms(template, [e.text for e in examples], n)
        import torch

        lm = self.target.lm
        before, after = prompt_frame(lm.tokenizer, template, self.task.template.chat_template)
        samples = []
        with torch.inference_mode():
            for example in list(examples)[:n]:
                t0 = time.perf_counter()
                ids = lm.tokenizer(before + example.text + after, return_tensors="pt", add_special_tokens=False).input_ids
                lm.model(input_ids=ids, logits_to_keep=1)
                samples.append((time.perf_counter() - t0) * 1000)
        return {"p50": float(np.percentile(samples, 50)), "p95": float(np.percentile(samples, 95))}

    def render_us_p99(self, template: Template, examples: Sequence[Example], repeats: int = 2000) -> float:
        values = [{self.task.input_variable: e.text} for e in examples[:50]]
        samples = []
        for i in range(repeats):
            v = values[i % len(values)]
            t0 = time.perf_counter_ns()
            template.render(v)
            samples.append((time.perf_counter_ns() - t0) / 1000)
        return float(np.percentile(samples, 99))

    def evaluate(self, text: str, split: str = "dev", *, latency: bool = True) -> Evaluation:
        """Every component of one template on one split, with the task's decision rule."""
        cfg = self.task
        examples = list(self.splits[split])
        check = self.validate(text)
        if not check.ok:
            m = Measured(template=text, valid=False, reasons=check.reasons, tokens=check.tokens,
                         max_tokens=cfg.template.max_tokens, reward_metric=cfg.scoring.reward_metric)
            return Evaluation(m, self.reward(m), split, len(examples), None)
        template = check.template
        timing = {}
        t0 = time.perf_counter()
        threshold = self.fit_threshold(template)
        timing["calibrate_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        preds, odds = self.predict(template, examples, threshold)
        gold = [e.label for e in examples]
        metrics = pbm.classification_metrics(preds, gold, self.labels, odds, cfg.positive_label)
        timing["target_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        pdr = self.robustness_pdr(template)
        timing["robustness_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        (judge,) = self.judge([template.text])
        timing["judge_s"] = time.perf_counter() - t0
        m = Measured(
            template=template.text, valid=True, tokens=check.tokens, max_tokens=cfg.template.max_tokens,
            metrics=metrics, reward_metric=cfg.scoring.reward_metric, chance=_reward_chance(cfg),
            pdr=pdr, judge=judge, timing=timing,
        )
        result = Evaluation(m, self.reward(m), split, len(examples), threshold)
        if latency:
            result.latency_ms = self.request_latency_ms(template, examples)
            result.render_us_p99 = self.render_us_p99(template, examples)
        return result
