"""Typed, validated configuration: one YAML file per task, grouped by stage.

Precedence: the defaults here < the task file < CLI flags (applied with ``TaskConfig.with_overrides``).
Unknown keys are rejected and every validation error names the field and the fix. This module is the schema
only; reading task and template files (their limits, built-in and package paths) is ``pipelines/task_files.py``.

The module is long because the schema is one tree, ``TaskConfig`` and its sections with every field's bounds and
description (docs/tasks.md is generated from them), plus the flag-only settings that share those bounds; it reads
best whole.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple, cast, get_args

import annotated_types

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipelines.engine.models import EMBEDDED
from rewards.components import components_for
from rewards.weighting import check_weights
from templates.contract import unknown_names
from templates.gate import PromotionConfig
from templates.template import MAX_INPUT_CHARS, Template, TemplateError, constraints_from_spec


GENERATION_METRICS = ("field_exact_match", "token_f1", "contract_rate")
MAX_LABELS = 50  # each label is one more answer word the target must be read for
# Upper bounds that no one means past (a typo, 1e30 or a pasted number are refused at load with one line, instead of
# a run that never ends, an allocation that fails or an estimate that counts for hours). Each Field says its own.
MAX_EXAMPLES = 100_000  # examples in a split or sample: each is scored for every candidate, so more takes days
MAX_SAMPLE_TOKENS = 10_000_000  # input tokens a sample may hold: at about 1,000 tokens/s per worker, days
MAX_CANDIDATES = 256  # candidates of one step: each is scored on its sample, and the PPO batch holds them all
MAX_STEPS = 10_000  # steps of a run: a step takes minutes, so 10,000 is weeks
MAX_WEIGHT = 100.0  # every reward component lies in -1..1: a larger weight only rescales what the clip range cuts


class ConfigError(ValueError):
    """A task file or option is not acceptable; the message names the file, the field and the fix."""


def excerpt(value: object, limit: int = 80) -> str:
    """``value`` escaped (repr) and cut to ``limit`` characters: what an error may show of a file it read."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def unknown_keys(keys: list, known=()) -> str:
    """Unknown keys as an error shows them (``unknown_names``: a count and the first one's name, cut), the fix,
    and the keys the place knows."""
    text = f"{unknown_names(keys)}; remove them or check their spelling"
    return text + (f"; known keys are {', '.join(known)}" if known else "")


class _Strict(BaseModel):
    # NaN or inf in any setting would poison the reward, the gate or every weight of the policy
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class LabelSpec(_Strict):
    values: tuple[str, ...] = Field(min_length=1, description="raw values of the label column that mean this label")
    verbalizer: str = Field(min_length=1, description="the word the target model answers with for this label")

    @field_validator("verbalizer")
    @classmethod
    def _a_word(cls, verbalizer: str) -> str:
        if not verbalizer.strip():
            raise ValueError("is only whitespace: give the word the target answers with, e.g. yes")
        return verbalizer


class DataConfig(_Strict):
    source: str = Field(description="a CSV/TSV/JSONL path (relative to the task file) or package:<pkg>/<path>")
    format: Literal["csv", "jsonl"] = Field("csv", description="csv (a TSV too, with delimiter) or jsonl (one JSON "
                                            "object a line); a .gz or .bz2 file is decompressed as it is read")
    delimiter: str = Field(",", description="one character between the fields of a CSV/TSV row")
    header: bool = Field(True, description="the CSV's first row names its columns; false: give columns")
    columns: tuple[str, ...] | None = Field(None, description="column names when the file has no header row")
    text_column: str = Field("text", description="the column of the input text; the template's input placeholder "
                             "has its name, e.g. {text}")
    input_columns: tuple[str, ...] = Field((), description="several inputs: the columns whose values fill the "
                                           "template's input placeholders, one each (default: text_column alone)")
    label_column: str = Field("label", description="classification: the column of the raw label values that "
                              "labels.<name>.values map")
    reference_column: str = Field("reference", description="generation tasks: the column holding each example's "
                                  "reference answer (JSON text for a json contract, plain text for a regex one)")
    reference_entity: Literal["url", "email", "phone", "amount", "date", "number"] | None = Field(
        None, description="generation tasks: instead of a reference column, each example's reference is the first "
        "entity of this type in its input (rewards.entities); rows without one are left out")
    drop_values: tuple[str, ...] = Field((), description="label-column values whose rows are dropped")
    dedupe: bool = Field(True, description="drop a row whose input repeats an earlier row's (the first is kept)")
    max_chars: int = Field(2000, ge=1, le=MAX_INPUT_CHARS, description="longer texts are cut to this many characters "
                           f"(at most {MAX_INPUT_CHARS:,}: about 25,000 tokens, past any target's context)")

    @field_validator("delimiter")
    @classmethod
    def _one_character(cls, delimiter: str) -> str:
        if len(delimiter) != 1 or delimiter in "\r\n\"":
            raise ValueError(f"got {excerpt(delimiter)}: give one character other than a quote or a line break, "
                             "e.g. ',' or '\\t'")
        return delimiter


class SplitConfig(_Strict):
    seed: int = Field(13, ge=0, le=2**32 - 1, description="seed of the data split (which examples are train, dev "
                      "and test), 0 to 2**32 - 1 as numpy takes it; the run's own seed is ppo.seed: a run with another "
                      "seed must not see other test data")
    balanced: bool = Field(True, description="equal examples per label in each split (else label proportions)")
    train: int = Field(200, ge=2, le=MAX_EXAMPLES, description="examples for calibration and tuning (never scored "
                       f"for promotion); 2 to {MAX_EXAMPLES:,}, as every split")
    dev: int = Field(200, ge=2, le=MAX_EXAMPLES, description="examples for the reward during tuning and the choice: "
                     "every shortlisted candidate is scored on all of them")
    test: int = Field(400, ge=2, le=MAX_EXAMPLES, description="held-out examples, only for final figures and the "
                      "promotion gate")


class TemplateConfig(_Strict):
    skeleton: str = Field(description="the fixed frame: {instruction} plus the input placeholder, each once")
    seed_instruction: str = Field("", description="the hand-written instruction put into the skeleton: the seed "
                                  "template the run starts from and every candidate is compared with")
    constraints: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="input placeholder -> checks its values must pass when rendered: "
        f"{{max_chars: N}} (N up to {MAX_INPUT_CHARS:,}), {{in: [...]}}, {{regex: '...'}} (RE2 syntax, a full match)")
    max_tokens: int = Field(192, ge=1, le=8192, description="token budget of a whole template (at most 8,192, the "
                            "embedded target's context)")
    max_instruction_tokens: int = Field(48, ge=1, le=512, description="how many tokens the policy may write (its max "
                                        "new tokens; at most 512, as an answer's)")
    chat_template: bool = Field(True, description="wrap the rendered prompt in the target model's chat template")


class AnswerConfig(_Strict):
    """How an application reads the target's answer: its output contract (``templates.contract``)."""

    rule: Literal["first_word", "exact"] = Field(
        "first_word",
        description="first_word: the answer's first word (case and surrounding punctuation ignored) must be a label's "
        "answer word; exact: the whole answer must be one answer word",
    )
    max_new_tokens: int = Field(4, ge=1, le=512, description="greedy answers stop here (cut off = a contract failure)")


class RacingConfig(_Strict):
    """Racing a step's candidates (``pipelines/racing.py``): all on a first slice of the dev sample, the best on
    the rest."""

    first_examples: int = Field(20, ge=0, le=MAX_EXAMPLES, description="dev examples every candidate of a step is "
                                "measured on first (the first of its sample); 0: no racing, every candidate on the "
                                "whole sample")
    screen: bool = Field(True, description="the first slice is a screen: the label log-probs and greedy answers "
                         "only (reward metric, instruction following, readability, length), no entity swaps, "
                         "perturbations or judge; the policy learns from that reward, which every sample has")
    keep: int = Field(2, ge=1, le=MAX_CANDIDATES, description="candidates of a step measured on the rest of the "
                      "sample (the best by reward on the slice); only they can enter the leaderboard")
    second: Literal["full", "screen"] = Field(
        "full", description="what the second rung measures on the whole sample: full: every component (answers, "
        "entity swaps, perturbations, judge); screen: what the first rung does (with screen), on more examples, "
        "for a steadier reward at a fraction of the cost, and the greedy answers of the first slice "
        "(instruction_following there): the choice then measures everything, on the dev split. "
        "The seed's step measurement is the same kind, so the leaderboard compares like with like")
    @property
    def screens_sample(self) -> bool:
        """Whether a screen measures the whole sample too (the second rung, and the seed ranked with it)."""
        return self.screen and self.second == "screen"

    first_tokens: int | None = Field(
        1500, ge=1, le=MAX_SAMPLE_TOKENS, description="input tokens the first slice may hold (at least 12 examples, or first_examples if "
        "fewer): a task of long inputs, whose dev sample scoring.dev_tokens already shortened, races on fewer "
        "examples (risk's first 20 messages hold about 630 tokens, snippets' 1,450); null: no limit")


class ScoringConfig(_Strict):
    decision: Literal["calibrated", "answer", "argmax", "threshold"] = Field(
        "calibrated",
        description="what production applies: calibrated: the label log-probs adjusted by values fitted on the train "
        "split to maximise balanced accuracy (two labels: the positive label wins when its log-odds exceed a "
        "threshold; more: an offset per label before the argmax); answer: the greedy answer parsed by the "
        "output contract (a broken contract is a failure); argmax: the most probable answer word. 'threshold' is "
        "the old name of calibrated",
    )
    answer: AnswerConfig = Field(AnswerConfig(), description="the output contract the target's greedy answers "
                                 "are held to (instruction_following)")
    metric: Literal["balanced_accuracy", "accuracy", "macro_f1", "roc_auc", *GENERATION_METRICS] = Field(
        "balanced_accuracy", description="the held-out metric reported and compared by the promotion gate "
        "(generation tasks: field_exact_match, token_f1 or contract_rate; default field_exact_match)"
    )
    reward_metric: Literal["roc_auc", "balanced_accuracy", "accuracy", "macro_f1", *GENERATION_METRICS] | None = Field(
        None,
        description="the dev metric inside the reward; default: roc_auc of the label log-odds (macro one-vs-rest for "
        "more than two labels) for calibrated and argmax decisions (threshold-free, no calibration pass), the held-out metric of the parsed answers for answer",
    )
    entity_rule: Literal["swap"] = Field(
        "swap", description="entity_consistency: swap: the decision stays the same when the input's entities (phone "
        "numbers, amounts, URLs, ...) are replaced by others of the same type",
    )
    judge_examples: int = Field(8, ge=1, le=1000, description="responses per candidate graded by the judge's "
                                "response rubrics (at most 1,000: each is a judge call per rubric and candidate)")
    batch_size: int = Field(64, ge=1, le=4096, description="examples per forward pass of the target, packed without "
                            "padding (at most 4,096: a larger batch only allocates more memory at once)")
    calibration_examples: int = Field(120, ge=2, le=MAX_EXAMPLES,
                                      description="train examples used to fit the calibrated decision")
    robustness_attacks: tuple[Literal["checklist", "stresstest"], ...] = Field(
        ("checklist", "stresstest"), description="PromptBench perturbations of the template, one variant each; "
        "robustness is the reward metric's drop rate (PDR) under them")
    robustness_examples: int = Field(20, ge=2, le=MAX_EXAMPLES, description="dev examples scored per perturbed "
                                     "template")
    robustness_tokens: int | None = Field(
        2000, ge=1, le=MAX_SAMPLE_TOKENS, description="input tokens the robustness sample may hold (at least 10 examples, or "
        "robustness_examples if fewer): each PromptBench variant scores the whole sample again, so a task of long "
        "inputs perturbs fewer of them (risk's 20 messages hold about 630); null: no limit")
    entity_tokens: int | None = Field(
        16000, ge=1, le=MAX_SAMPLE_TOKENS, description="classification tasks: input tokens of the entity-bearing inputs that "
        "entity_consistency swaps and scores again, per template and sample or split (the first ones, at least 24 "
        "inputs): a task of long inputs checks a sample of its test split rather than all of it; the rate's "
        "denominator says how many (the 219 of risk's 400 test messages that have entities hold about 11,200); "
        "null: every input")
    racing: RacingConfig = Field(RacingConfig(), description="how a step's candidates race: all on a first "
                                 "slice, the best on the rest")
    search_split: Literal["train", "dev"] = Field(
        "train", description="the split a step's rewards read (the search sample): train keeps the dev split for the "
        "choice alone, so its paired test against the seed is not run on the examples the shortlist was picked on "
        "(on dev, a candidate picked on dev's first 100 examples won +0.070 over the seed, p 0.014, and +0.005 on "
        "test); dev: the former way")
    dev_tokens: int | None = Field(
        7000, ge=1, le=MAX_SAMPLE_TOKENS, description="input tokens a candidate's dev sample may hold (the selection sample: twice that): "
        "a task of long inputs reads fewer examples per reward, so a run's cost follows tokens (risk's 100 SMS "
        "messages hold about 3,600, snippets' 100 reviews 6,900); null: no limit")
    min_dev_examples: int = Field(24, ge=2, le=MAX_EXAMPLES,
                                  description="the dev sample's size however long the inputs")

    @model_validator(mode="before")
    @classmethod
    def _resolve(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("decision") == "threshold":
            data["decision"] = "calibrated"
        if data.get("reward_metric") is None:
            answer = data.get("decision") == "answer"
            data["reward_metric"] = data.get("metric", "balanced_accuracy") if answer else "roc_auc"
        return data

    @model_validator(mode="after")
    def _answers_have_no_scores(self) -> "ScoringConfig":
        if self.decision == "answer" and "roc_auc" in (self.metric, self.reward_metric):
            raise ValueError("scoring: parsed answers carry no scores to rank, so an answer decision cannot use "
                             "roc_auc; use balanced_accuracy, accuracy or macro_f1")
        return self


class OutputConfig(_Strict):
    """A generation task's answer: the contract it must keep (``templates.contract``) and its token limit. Each
    example's reference answer is in ``data.reference_column``; the decision is the parsed answer."""

    contract: dict[str, Any] = Field(description="{kind: json, schema: {...}} (a JSON Schema subset: type, "
                                     "properties, required, enum, pattern, minLength/maxLength, minimum/maximum, "
                                     "items, ...) or {kind: regex, pattern: ...}; patterns are RE2 syntax (no "
                                     "backreferences or lookaround: such a pattern is refused)")
    max_new_tokens: int = Field(96, ge=1, le=512, description="greedy answers stop here (cut off = a contract failure)")

    def output_contract(self):
        from templates.contract import ContractError, OutputContract

        if self.contract.get("kind") not in ("json", "regex"):
            raise ValueError("output.contract.kind must be json or regex (a task with labels declares labels: "
                             "instead of output:)")
        try:
            return OutputContract(**self.contract)
        except (ContractError, TypeError) as exc:
            raise ValueError(f"output.contract: {' '.join(str(exc).split())[:300]}") from None


class JudgeConfig(_Strict):
    rubrics: dict[str, str] = Field(
        default_factory=dict,
        description="component name -> a yes/no question about one (input, response) pair; the judge grades "
        "scoring.judge_examples responses per candidate and the component is the mean P(yes)")
    template_rubrics: dict[str, str] = Field(
        default_factory=dict, description="component name -> a yes/no question about the template's own text")
    max_errors: int = Field(5, ge=0, le=10_000, description="judge failures tolerated in one run before it stops "
                            "(at most 10,000: past that, the judge is down)")

    @model_validator(mode="after")
    def _distinct(self) -> "JudgeConfig":
        both = sorted(set(self.rubrics) & set(self.template_rubrics))
        if both:
            raise ValueError(f"judge: {both} named both as a response rubric and a template rubric; rename one")
        return self

    @property
    def all_rubrics(self) -> dict[str, str]:
        return {**self.rubrics, **self.template_rubrics}


class RewardConfig(_Strict):
    weights: dict[str, Annotated[float, Field(ge=-MAX_WEIGHT, le=MAX_WEIGHT)]] = Field(
        description=f"reward component -> weight in the total, -{MAX_WEIGHT:g} to {MAX_WEIGHT:g}: every component "
        "lies in -1..1, so a larger weight only rescales the reward that ppo.reward_clip_range then cuts")
    invalid_penalty: float = Field(-1.0, ge=-MAX_WEIGHT, le=0, description="the total reward of an unusable "
                                   f"candidate, -{MAX_WEIGHT:g} to 0: above 0 it would reward one")

    @field_validator("weights")
    @classmethod
    def _finite(cls, weights: dict[str, float]) -> dict[str, float]:
        if not weights:
            raise ValueError("give at least one reward weight")
        return weights


class PromotionSettings(_Strict):
    """The promotion gate's bars (``templates.gate.PromotionConfig``; its metric is ``scoring.metric`` and its
    token budget ``template.max_tokens``). No task's thresholds are defaults: a task states its own."""

    thresholds: dict[str, Annotated[float, Field(ge=-1, le=1)]] = Field(
        default_factory=dict, description="reward component -> minimum on the held-out split, -1 to 1: every "
        "component lies there (a rate, a probability, a normalised metric or a penalty), so a bar outside it "
        "could never be met or never fail")
    min_improvement: float = Field(0.01, ge=0, le=1,
                                   description="held-out metric gain over production needed to promote")
    max_latency_p95_increase: float = Field(0.2, ge=0, le=10, description="allowed p95 latency increase over "
                                            "production, a fraction (at most 10: eleven times as slow is no bar)")
    max_render_us: float = Field(80.0, gt=0, le=1_000_000, description="p99 render time budget, microseconds (at "
                                 "most 1,000,000: a second)")
    max_error_rate: float = Field(0.02, ge=0, le=1, description="allowed fraction of failed target requests")


class SelectionConfig(_Strict):
    """How a run chooses what goes to the held-out test (``pipelines/choice.py``): the gate's own bars read on the
    dev split, with margins, and a paired test against the seed, which is always in the ranking."""

    shortlist: int = Field(2, ge=1, le=MAX_CANDIDATES, description="candidates of the run (the best by step reward "
                           "among those that met the bars in their step) evaluated on the whole dev split beside the "
                           f"seed (1 to {MAX_CANDIDATES}; the CLI's --finalists overrides it)")
    rate_margin: float = Field(
        0.03, ge=0, le=0.5, description="a rate (instruction_following, entity_consistency, readability) must clear "
        "its promotion threshold on dev by this much: dev and test are different samples (about +-0.03 at 200 and "
        "400 examples), and bfloat16 greedy answers may differ from float32 ones in a few per cent of cases")
    latency_margin: float = Field(
        0.1, ge=0, lt=1, description="in the search and the shortlist, a candidate's latency is predicted from its "
        "prompt tokens (their ratio to the seed's), and must stay this fraction under the gate's ceiling (1 + "
        "promotion.max_latency_p95_increase); the choice on dev times the requests and bounds their ratio to the "
        "seed's at alpha against the gate's ceiling itself")
    alpha: float = Field(0.05, gt=0, lt=0.5, description="one-sided level of the paired bootstrap over dev examples: a "
                         "candidate goes to test only if its gain over the seed on the gate's metric is above 0 at this level")
    bootstrap: int = Field(2000, ge=100, le=100000, description="bootstrap resamples of the dev examples")
    prefer_shorter: bool = Field(True, description="among the candidates not significantly worse than the best "
                                 "(the same paired test), choose the one with the fewest template tokens")


class GenerationConfig(_Strict):
    """How the policy writes candidates."""

    candidates_per_step: int = Field(8, ge=2, le=MAX_CANDIDATES, description="instructions sampled per step (the "
                                     f"PPO batch), 2 to {MAX_CANDIDATES}: each is scored on its sample every step; "
                                     "the CLI's --candidates overrides it")
    # Measured on risk's meta-prompt (12 samples each): at temperature 1.0 the 135M policy writes mostly fluent
    # nonsense; at 0.7 with top_p 0.9 most samples are on-task sentences an analyst could read.
    temperature: float = Field(0.7, gt=0, le=5, description="sampling temperature of the policy (at most 5: past 2 "
                               "the samples are already noise)")
    top_p: float = Field(0.9, gt=0, le=1, description="nucleus sampling of the policy")
    meta_prompt: str = Field(
        "You write instructions for an AI assistant that classifies short texts.\n"
        "Task: {description}\n"
        "Current instruction: \"{instruction}\"\n"
        "Weakest points of the current prompt: {weaknesses}.\n"
        "Write a better instruction for this task in one short sentence. Reply with the instruction only.",
        description="what the policy reads; fills {description}, {instruction}, {weaknesses} (one short sentence: "
        "a longer prompt is a slower request, and the gate bounds latency)",
    )


class PPOConfig(_Strict):
    """The policy update (``pipelines.rl.ppo.PPOLearner``; the cluster job passes the same values to openrlhf).

    The group of the group estimators is not set here: it is the samples per prompt, which the caller
    passes to the learner (the loop: ``generation.candidates_per_step``).
    """

    steps: int = Field(4, ge=1, le=MAX_STEPS, description="steps of the loop (sample a group, score it, update the "
                       f"policy), 1 to {MAX_STEPS:,} (a step takes minutes); the CLI's --steps overrides it")
    # The default is "none" because that is what won at equal budget: after the gate PPO minus best-of-N is -0.001
    # [-0.002, 0.000] over the 4 built-ins x 3 seeds, and expert iteration is behind both (docs/results.md#fresh-bench;
    # the loop without an update against PPO: #default-in-bench), so neither update earns its cost by default; ppo
    # stays one setting away.
    update: Literal["none", "ppo", "expert_iteration", "expert_iteration+ppo"] = Field(
        "none", description="how a step's rewarded samples train the policy: none (no update: each step's group is "
        "drawn from the untrained policy, best-of-N with the loop's screening and choice; the default, as no update "
        "beat it in the bench), ppo (openrlhf's clipped loss with the advantage estimator below), expert_iteration "
        "(a supervised step on the step's best samples: those above their group's mean reward, at most expert_top_k "
        "of them), or expert_iteration+ppo (the supervised step, then PPO); the cluster job (--backend openrlhf) "
        "trains with ppo whether this says none or ppo, and refuses expert iteration")
    expert_top_k: int = Field(4, ge=1, le=MAX_CANDIDATES, description="expert iteration: at most this many of a "
                              "group's samples are imitated, the best by reward, each above the group's mean and "
                              "ended by a stop token")
    expert_epochs: int = Field(4, ge=1, le=100, description="expert iteration: passes over a step's imitated "
                               "samples, in minibatches of minibatch_size (at most 100)")
    advantage_estimator: Literal[
        "gae", "reinforce", "rloo", "reinforce_baseline", "group_norm", "dr_grpo", "flash_reinforce"
    ] = Field("gae", description="openrlhf's advantage estimator; only gae trains a critic (the value head)")
    gamma: float = Field(1.0, ge=0, le=1, description="discount; must be 1.0 for every estimator but gae and reinforce")
    lambd: float = Field(0.95, ge=0, le=1, description="GAE lambda")
    # a clip range is [1 - eps, 1 + eps]: eps <= 0 would turn it around
    clip_eps: float = Field(0.2, gt=0, lt=1, description="PPO ratio clip range")
    value_clip_eps: float | None = Field(0.2, gt=0, le=100, description="value clip range (at most 100, past any "
                                         "clipped reward), or None for an unclipped value loss")
    kl_coef: float = Field(0.02, ge=0, le=100, description="initial coefficient of the KL penalty in the reward (at "
                           "most 100: past that the penalty is all the reward)")
    kl_target: float | None = Field(None, gt=0, le=100, description="None: a fixed KL coefficient; else the adaptive "
                                    "target KL (at most 100 nats)")
    kl_horizon: int = Field(10000, ge=1, le=10_000_000, description="horizon of the adaptive KL controller, in "
                            "samples (at most 10,000,000: the controller would never move)")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k1", description="openrlhf's per-token estimate of the KL to "
                                                    "the reference policy: k1 the log-ratio, k2 and k3 lower-variance "
                                                    "approximations")
    ppo_epochs: int = Field(2, ge=1, le=100, description="passes over each rollout batch (at most 100: more only "
                            "overfits one batch)")
    minibatch_size: int = Field(4, ge=1, le=MAX_CANDIDATES, description="samples per optimizer step (at most "
                                f"{MAX_CANDIDATES}, a step's candidates)")
    lr: float = Field(2e-4, gt=0, le=1, description="AdamW learning rate of the LoRA adapter (at most 1)")
    critic_lr: float = Field(1e-3, gt=0, le=1, description="AdamW learning rate of the value head (at most 1)")
    max_grad_norm: float = Field(1.0, gt=0, le=1000, description="gradient clipping, per optimizer step (at most "
                                 "1,000: past that nothing is clipped)")
    lora_rank: int = Field(8, ge=1, le=1024, description="rank of the policy's LoRA adapter (at most 1,024: past a "
                           "layer's width, a full update)")
    lora_alpha: int = Field(16, ge=1, le=4096, description="LoRA scaling: the adapter's update is multiplied by "
                            "lora_alpha / lora_rank (at most 4,096)")
    lora_target_modules: tuple[str, ...] = Field(
        ("q_proj", "k_proj", "v_proj", "o_proj"), description="module names that get a LoRA adapter"
    )
    reward_clip_range: tuple[Annotated[float, Field(ge=-1000, le=1000)], Annotated[float, Field(ge=-1000, le=1000)]] = (
        Field((-10.0, 10.0), description="(low, high) applied to the rewards before the KL penalty, each within "
              "-1,000..1,000 (a reward is at most weights x components, 100 x a few)"))
    seed: int = Field(0, ge=0, le=2**32 - 1,
                      description="the run's seed: sampling, minibatch order, the cluster job's --train.seed")

    @model_validator(mode="after")
    def _consistent(self) -> "PPOConfig":
        if self.gamma != 1.0 and self.advantage_estimator not in ("gae", "reinforce"):
            # openrlhf would reset it to 1.0 with only a log line; refuse instead of training on another value
            raise ValueError(
                f"gamma is {self.gamma}, but advantage_estimator {self.advantage_estimator!r} needs gamma 1.0 "
                "(openrlhf discounts only for gae and reinforce): set ppo.gamma to 1.0 or choose gae or reinforce"
            )
        low, high = self.reward_clip_range
        if not low < high:
            raise ValueError(
                f"reward_clip_range is {self.reward_clip_range}: give it as [low, high] with low < high, "
                "e.g. [-10, 10]"
            )
        return self


# The choices, read from PPOConfig's annotation so that nothing restates them.
ADVANTAGE_ESTIMATORS: tuple[str, ...] = get_args(PPOConfig.model_fields["advantage_estimator"].annotation)


class TaskConfig(_Strict):
    """Everything that defines a task. Built-ins live in pipelines/tasks/*.yaml."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_-]*$", description="lowercase letters, digits, - and _: the store "
                      "keeps the task's template versions under it, and a run's folder is named after it")
    description: str = Field(description="what the task decides, in a few sentences: the policy reads it to write "
                             "instructions, and the judge and the readability scorer read it beside what they grade")
    data: DataConfig = Field(description="where the examples come from and which columns hold what")
    labels: dict[str, LabelSpec] = Field(default_factory=dict, max_length=MAX_LABELS,
                                         description="classification: two or more labels (a generation task has none)")
    output: OutputConfig | None = Field(None, description="generation: the answer's contract (then no labels)")
    positive_label: str | None = Field(None, description="two labels: the one whose log-odds the calibrated "
                                       "threshold cuts (e.g. high_risk); more labels: leave it out")
    split: SplitConfig = Field(SplitConfig(), description="the train/dev/test split: sizes and seed")
    template: TemplateConfig = Field(description="the skeleton, the seed instruction, input constraints and token "
                                     "budgets; or the path of a YAML file holding them")
    scoring: ScoringConfig = Field(ScoringConfig(), description="how a template is measured: the decision, the "
                                   "metrics and the samples each reward component reads")
    judge: JudgeConfig = Field(description="the LLM judge's yes/no rubrics (may be empty: judge: {})")
    reward: RewardConfig = Field(description="the weight of each reward component in a candidate's total reward")
    promotion: PromotionSettings = Field(PromotionSettings(), description="the promotion gate's bars on the "
                                         "held-out split")
    selection: SelectionConfig = Field(SelectionConfig(), description="how a run chooses the candidate that goes "
                                       "to the held-out test")
    generation: GenerationConfig = Field(GenerationConfig(), description="how the policy samples candidate "
                                         "instructions")
    ppo: PPOConfig = Field(PPOConfig(), description="the policy update (PPO and its relatives, on a LoRA adapter)")
    base_dir: Path = Field(Path("."), exclude=True, description="folder of the task file; relative paths start here")

    @model_validator(mode="before")
    @classmethod
    def _generation_defaults(cls, data: Any) -> Any:
        """A generation task's only decision is its parsed answer, measured by default on field exact match."""
        if isinstance(data, dict) and data.get("output") is not None:
            scoring = data.get("scoring") or {}
            if isinstance(scoring, dict):  # anything else is the scoring section's own error to report
                data = {**data, "scoring": {"decision": "answer", "metric": "field_exact_match", **scoring}}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "TaskConfig":
        if self.output is not None:
            self._check_generation()
        elif len(self.labels) < 2:
            raise ValueError("give two or more labels (a classification task), or an output: section with the "
                             "answer's contract (a generation task)")
        elif {self.scoring.metric, self.scoring.reward_metric} & set(GENERATION_METRICS):
            raise ValueError("scoring: field_exact_match, token_f1 and contract_rate measure generated answers "
                             "against references; a task with labels uses balanced_accuracy, accuracy, macro_f1 or "
                             "roc_auc")
        if self.output is None and self.data.reference_entity is not None:
            raise ValueError("data.reference_entity gives a generation task its references; a task with labels "
                             "reads data.label_column: remove data.reference_entity")
        if len(self.labels) == 2 and self.positive_label not in self.labels:
            raise ValueError(f"positive_label {excerpt(self.positive_label)} is not one of the labels "
                             f"{list(self.labels)}: with two labels, name the one the calibrated threshold decides")
        if len(self.labels) > 2 and self.positive_label is not None:
            raise ValueError(f"positive_label is for two labels; with {len(self.labels)} the calibrated decision fits "
                             "an offset per label: remove positive_label")
        seen: dict[str, str] = {}
        for name, spec in self.labels.items():
            for value in spec.values:
                if value in seen:
                    raise ValueError(f"label value {value!r} belongs to both {seen[value]!r} and {name!r}")
                seen[value] = name
        verbalizers = [spec.verbalizer for spec in self.labels.values()]
        if len(set(verbalizers)) != len(verbalizers):
            raise ValueError(f"verbalizers must differ between labels, got {verbalizers}")
        check_weights(self.reward.weights, self.components())  # before any model is loaded
        self.skeleton()  # raises for a bad skeleton
        self.seed_template()  # raises for a bad seed instruction or constraint
        self.promotion_config()  # raises for bad promotion settings
        return self

    def _check_generation(self) -> None:
        if self.labels or self.positive_label is not None:
            raise ValueError("a generation task (output:) has no labels or positive_label; its answers are compared "
                             "with data.reference_column")
        self.output.output_contract()  # raises for a bad contract
        if self.scoring.decision != "answer":
            raise ValueError(f"scoring.decision is {self.scoring.decision!r}, but a generation task's decision is its "
                             "parsed answer: remove scoring.decision or set it to answer")
        wrong = [m for m in (self.scoring.metric, self.scoring.reward_metric) if m not in GENERATION_METRICS]
        if wrong:
            raise ValueError(f"scoring: {wrong[0]!r} needs labels; a generation task is measured by "
                             f"{', '.join(GENERATION_METRICS)}")

    # --- derived objects -------------------------------------------------------------------
    @property
    def is_generation(self) -> bool:
        return self.output is not None

    @property
    def input_variable(self) -> str:
        """The first input placeholder (the only one unless ``data.input_columns`` names several)."""
        return self.input_variables[0]

    @property
    def input_variables(self) -> tuple[str, ...]:
        return self.data.input_columns or (self.data.text_column,)

    def skeleton(self) -> Template:
        try:
            skeleton = Template(self.template.skeleton, ("instruction", *self.input_variables))
        except TemplateError as exc:
            raise ValueError(f"template.skeleton: {exc}") from None
        if skeleton.placeholders[0] != "instruction":
            raise ValueError("template.skeleton must put {instruction} before the input placeholders")
        return skeleton

    def compose(self, instruction: str) -> str:
        """Template text with ``instruction`` put into the skeleton; the input placeholder stays a placeholder.

        The instruction is inserted raw, so braces in it stay braces: an instruction that adds a
        placeholder makes the composed template invalid, which validation then reports.
        """
        skeleton = self.template.skeleton
        i = skeleton.index("{instruction}")
        return skeleton[:i] + instruction.strip() + skeleton[i + len("{instruction}") :]

    def seed_template(self) -> Template:
        return self.make_template(self.compose(self.template.seed_instruction))

    def make_template(self, text: str) -> Template:
        try:
            return Template(text, self.input_variables, tuple(constraints_from_spec(self.template.constraints)))
        except TemplateError as exc:
            raise ValueError(f"template: {exc}") from None

    def promotion_config(self) -> PromotionConfig:
        """The gate's bars: the promotion section, with the metric and token budget the task already states."""
        try:
            return PromotionConfig(metric=self.scoring.metric, max_template_tokens=self.template.max_tokens,
                                   **self.promotion.model_dump())
        except (TypeError, ValueError) as exc:
            raise ValueError(f"promotion: {exc}") from None

    def latency_ceiling(self) -> float:
        """The predicted latency ratio over the seed (``Measured.prompt_ratio``) that the search and the shortlist
        let a candidate reach: the gate's ceiling (1 + ``promotion.max_latency_p95_increase``) less
        ``selection.latency_margin`` of it. (The choice on dev reads measured requests instead, ``choice.latency_bound``.)"""
        return (1 + self.promotion.max_latency_p95_increase) * (1 - self.selection.latency_margin)

    def components(self) -> dict:
        """Every reward component function, by name: the fixed ones, then one per judge rubric (the shortfall's
        latency ceiling is the choice's: a candidate the choice would refuse as slow earns less)."""
        return components_for(self.judge.all_rubrics, self.promotion.thresholds, self.latency_ceiling())

    @property
    def component_names(self) -> tuple[str, ...]:
        """Every reward component, weighted or only logged: the fixed ones, then one per judge rubric."""
        return tuple(self.components())

    @property
    def verbalizers(self) -> list[str]:
        """The answer word of each label, in label order."""
        return [spec.verbalizer for spec in self.labels.values()]

    def with_overrides(self, **changes: Any) -> "TaskConfig":
        """A copy with dotted-path overrides, e.g. ``{"split.test": 100}``, validated again."""
        data = self.model_dump()
        for dotted, value in changes.items():
            node = data
            *parents, leaf = dotted.split(".")
            for key in parents:
                node = node.get(key) if isinstance(node, dict) else None
            if not isinstance(node, dict) or leaf not in node:
                raise ConfigError(f"unknown setting {excerpt(dotted)}; name one as section.key, e.g. split.test")
            node[leaf] = value
        return parse_task(data, self.base_dir, f"task {self.name!r} with overrides")


def parse_task(data: dict, base_dir: Path, origin: str) -> TaskConfig:
    """``data`` (a task file's mapping, ``base_dir`` its folder) as a TaskConfig; a refusal is one ConfigError
    that names ``origin``, the first few fields and their fix, and only counts unknown keys."""
    try:
        return TaskConfig.model_validate({**data, "base_dir": base_dir})
    except ValidationError as exc:
        problems, unknown = [], []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            if err["type"] == "extra_forbidden":
                unknown.append(where)
                continue
            if not re.fullmatch(r"[\w.-]{1,80}", where):  # a key from the file: show it escaped and short
                where = excerpt(where, 40)
            msg = " ".join(err["msg"].split())  # one line
            if err["type"] == "missing":
                msg = "required; add it"
            problems.append(f"{where}: {msg[:300]}")
        if unknown:  # counted, and the first named: a file of other keys must not come back in the message
            problems.insert(0, unknown_keys(unknown))
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise ConfigError(f"{origin} is invalid: " + "; ".join(problems[:3]) + more) from None


class FlagSettings(_Strict):
    """The settings that only command-line flags give (a run's ``RunOptions``, a served model's ``Endpoint``, the
    drift check and the scheduler), with their bounds: each flag's argparse type reads its field here
    (``pipelines.cli_flags.setting``), as the flags that override a task file's settings read the task's fields."""

    num_scorers: int = Field(2, ge=1, le=1024, description="Ray scoring actors (a run uses at most one per CPU; "
                             "1,024 is a large cluster)")
    dev_examples: int = Field(100, ge=0, le=MAX_EXAMPLES, description="dev examples per candidate reward; 0: all")
    max_target_calls: int | None = Field(None, ge=1, le=10**12, description="budget: target calls (at most 10**12, "
                                         "centuries of requests)")
    max_tokens: int | None = Field(None, ge=1, le=10**15, description="budget: target and judge tokens")
    max_concurrency: int = Field(4, ge=1, le=256, description="requests in flight per scorer (each Ray scoring "
                                 "actor holds one)")
    timeout_s: float = Field(30.0, ge=0.1, le=600, description="seconds one try of a request may take, all of it: "
                             "connect, send, first byte and whole body (a trickling server cannot stretch it)")
    deadline_s: float = Field(60.0, ge=0.1, le=3600, description="seconds one request may take in all: its tries, "
                              "backoffs and Retry-After waits")
    max_retries: int = Field(3, ge=0, le=10, description="retries after a timeout, a dropped connection, 429 or 5xx, "
                             "with backoff, inside the deadline; then the run stops, resumable")
    max_retry_after_s: float = Field(10.0, ge=0, le=600, description="the longest Retry-After of a 429 or 503 "
                                     "that is honoured")
    breaker_failures: int = Field(8, ge=1, le=1000, description="failed tries in a row (any request) after which "
                                  "every request to that server fails at once")
    top_logprobs: int = Field(20, ge=1, le=1000, description="alternatives asked for per position: OpenAI's limit, "
                              "vLLM's default --max-logprobs (a server allows at most its vocabulary)")
    min_metric: float | None = Field(None, ge=0, le=1, description="the drift check's bar for the held-out metric "
                                     "(every metric is a fraction)")
    max_drop: float = Field(0.05, ge=0, le=1, description="the drift check's allowed drop of the held-out metric "
                            "(0.05: about the 95% interval of balanced accuracy on 400 balanced test examples)")
    every_s: float | None = Field(None, ge=1, le=366 * 86400, description="the scheduler's interval in seconds (1 "
                                  "to a year)")
    max_ticks: int | None = Field(None, ge=1, le=1_000_000, description="ticks before the scheduler stops")
    poll_s: float = Field(2.0, ge=0.1, le=3600, description="seconds between the scheduler's job status polls")


def _flag_default(name: str):
    return FlagSettings.model_fields[name].default


class Bounds(NamedTuple):
    """What a numeric field accepts: from ``low`` (or more than it, with ``above``) to ``high``."""

    low: float
    high: float
    above: bool = False

    def admit(self, value: float) -> bool:
        return self.low <= value <= self.high and not (self.above and value == self.low)

    def __str__(self) -> str:
        return f"{'more than' if self.above else 'from'} {self.low:,.12g} to {self.high:,.12g}"


def bounds_of(model: type[BaseModel], name: str) -> Bounds:
    """The bounds ``model``'s field ``name`` states with its Field's ge, gt and le: the one reading of them, for the
    YAML's checks (pydantic's own), a flag's argparse type (``cli_flags.setting``) and ``Endpoint``."""
    low, high, above = -math.inf, math.inf, False
    for bound in model.model_fields[name].metadata:
        if isinstance(bound, annotated_types.Ge):
            low = cast(float, bound.ge)
        elif isinstance(bound, annotated_types.Gt):
            low, above = cast(float, bound.gt), True
        elif isinstance(bound, annotated_types.Le):
            high = cast(float, bound.le)
        elif isinstance(bound, annotated_types.Lt):  # a flag's message says "to HIGH": give the bound as le
            raise TypeError(f"{model.__name__}.{name}: give the upper bound as le, not lt")
    return Bounds(low, high, above)


# the Endpoint fields FlagSettings bounds (a served model's waits, retries and concurrency)
ENDPOINT_FIELDS = ("max_concurrency", "timeout_s", "deadline_s", "max_retries", "max_retry_after_s",
                   "breaker_failures", "top_logprobs")


@dataclass(frozen=True)
class Endpoint:
    """A model served over an OpenAI-compatible API (vLLM, TGI, a gateway). The key is read from the
    environment variable ``api_key_env``, never passed around. Every wait is bounded (``FlagSettings`` holds the
    bounds): a request ends within ``deadline_s`` however the server behaves (pipelines/engine/endpoints.py)."""

    url: str
    model: str
    api_key_env: str = "TUNE_PROMPTS_API_KEY"
    max_concurrency: int = _flag_default("max_concurrency")  # requests in flight per scorer
    timeout_s: float = _flag_default("timeout_s")  # one try of a request, all of it
    max_retries: int = _flag_default("max_retries")  # after a timeout, a dropped connection, 429 or 5xx
    top_logprobs: int = _flag_default("top_logprobs")  # alternatives asked for per position
    deadline_s: float = _flag_default("deadline_s")  # one request in all: tries, backoffs and waits
    max_retry_after_s: float = _flag_default("max_retry_after_s")  # a Retry-After is honoured up to this
    breaker_failures: int = _flag_default("breaker_failures")  # failed tries in a row before failing at once

    def __post_init__(self) -> None:
        for name in ENDPOINT_FIELDS:
            value = getattr(self, name)
            bounds = bounds_of(FlagSettings, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not bounds.admit(value):
                raise ConfigError(f"endpoint {name}={value!r} is out of range: give a number {bounds}")


ModelSource = str | Endpoint  # a model id, folder or EMBEDDED; or a served model


@dataclass(frozen=True)
class RunOptions:
    """How one tuning run executes (what it tunes is the TaskConfig): models, Ray, the run folder, outputs."""

    steps: int = 4
    policy_model: str = EMBEDDED
    target: ModelSource = EMBEDDED
    judge: ModelSource | None = None  # None: the target judges
    num_scorers: int = _flag_default("num_scorers")  # Ray scoring actors (capped at the CPUs Ray has)
    ray_address: str | None = None
    run_dir: str = "runs/latest"
    finalists: int | None = None  # candidates evaluated on dev beside the seed; None: the task's selection.shortlist
    dev_examples: int | None = _flag_default("dev_examples")  # dev examples per reward (None: the whole split)
    wandb_mode: str = "offline"
    wandb_project: str = "tune-prompts"
    wandb_entity: str | None = None
    store_url: str | None = None  # None: no store
    promote: bool = True
    progress: bool = True
    max_target_calls: int | None = None  # budget: calls to the target (pipelines/budget.py); None: no cap
    max_tokens: int | None = None  # budget: prompt + completion tokens of the target and the judge; None: no cap
    # None: the whole run. "steps": end after the tuning steps (no choice, test or store): a study of the learning.
    # "choice": end after the choice on dev (no held-out test, gate or store): the finalists and their bars.
    stop_after: str | None = None


# Reading task files moved to pipelines/task_files.py; these names stay importable from here, where tests, scripts
# and other branches import them. Looked up on first use, since task_files imports this module.
_TASK_FILE_NAMES = frozenset({"BUILTIN_TASKS_DIR", "MAX_TASK_FILE_BYTES", "MAX_TASK_FILE_DEPTH", "builtin_tasks",
                              "check_file", "load_task", "load_yaml_mapping", "resolve_source"})


def __getattr__(name: str):
    if name in _TASK_FILE_NAMES:
        from pipelines import task_files

        return getattr(task_files, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
