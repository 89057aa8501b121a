"""The production decision: how an application turns the target model's output into a label.

A decision rule ships with each template version (inside its record, so it is as immutable as the text and
part of its content hash), and the serving API applies it (``templates.serving.TemplateReader.predict``).
The held-out figures a version records are the figures of this rule, computed by the same function.

Two kinds, as the task file declares (``scoring.decision``):

* ``calibrated``: the target's label log-probabilities (normalised over the labels' answer words), adjusted by
  values fitted on the train split: with two labels a threshold on the positive label's log-odds; with more, an
  offset per label added before the argmax. An application needs the log-probs and these values; both come
  with the version.
* ``argmax``: the label whose answer word is most probable. No fitted value.
* ``answer``: the target's greedy answer (at most ``max_new_tokens`` new tokens), parsed by the output
  contract (``templates.contract``): an answer that breaks it is a failure, which the application sees as such.
  A classification task's contract maps the answer to a label; a generation task's (JSON or regex) has no
  labels, and its result is the parsed value.

Pure: no model, no I/O. Log-probs or an answer in, a label (or a failed parse) out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Sequence

from templates.contract import ContractError, OutputContract, Parsed, unknown_names

KINDS = ("calibrated", "argmax", "answer")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class DecisionError(ValueError):
    """A decision rule or its input is not acceptable; the message names the fix."""


@dataclass(frozen=True)
class DecisionRule:
    kind: str
    labels: tuple[str, ...]  # label names, in the order of the log-probs
    verbalizers: tuple[str, ...]  # the answer word of each label
    positive: str | None = None  # calibrated: the label whose log-odds are compared with the threshold
    threshold: float | None = None  # calibrated: log-odds above it decide ``positive``
    contract: OutputContract | None = None  # answer: how the answer is parsed
    max_new_tokens: int | None = None  # answer: the greedy answer's token limit
    offsets: tuple[float, ...] | None = None  # calibrated, 3+ labels: added to the log-probs before the argmax

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", tuple(self.labels))
        object.__setattr__(self, "verbalizers", tuple(self.verbalizers))
        if self.kind not in KINDS:
            raise DecisionError(f"decision kind {self.kind!r} is not one of {list(KINDS)}")
        generated = self.kind == "answer" and isinstance(self.contract, OutputContract) and self.contract.kind != "labels"
        if generated:
            if self.labels or self.verbalizers:
                raise DecisionError(f"an answer decision under a {self.contract.kind} contract has no labels or "
                                    "answer words; its result is the parsed answer")
        elif len(self.labels) < 2 or len(self.labels) != len(self.verbalizers) or len(set(self.labels)) != len(self.labels):
            raise DecisionError(f"a decision needs two or more distinct labels, each with its answer word; got "
                                f"labels {list(self.labels)} and answer words {list(self.verbalizers)}")
        if self.offsets is not None:
            if isinstance(self.offsets, (str, bytes, Mapping)) or not hasattr(self.offsets, "__iter__"):
                raise DecisionError(f"offsets must be a list of numbers, not {self.offsets!r}")
            object.__setattr__(self, "offsets", tuple(self.offsets))
        if self.kind == "calibrated" and len(self.labels) == 2:
            if self.positive not in self.labels:
                raise DecisionError("a calibrated decision over two labels names the positive one")
            if not _finite(self.threshold):
                raise DecisionError(f"a calibrated decision needs a finite threshold, not {self.threshold!r}")
            if self.offsets is not None:
                raise DecisionError("a calibrated decision over two labels has a threshold, not offsets")
        elif self.kind == "calibrated":
            if self.positive is not None or self.threshold is not None:
                raise DecisionError("a calibrated decision over three or more labels has offsets, not a positive "
                                    "label and a threshold")
            if self.offsets is None or len(self.offsets) != len(self.labels) or not all(map(_finite, self.offsets)):
                raise DecisionError(f"a calibrated decision over {len(self.labels)} labels needs one finite offset "
                                    f"per label, not {self.offsets!r}")
        elif self.positive is not None or self.threshold is not None or self.offsets is not None:
            raise DecisionError(f"an {self.kind} decision has no positive label, threshold or offsets")
        if self.kind == "answer":
            if not isinstance(self.contract, OutputContract):
                raise DecisionError("an answer decision needs its output contract")
            if self.contract.kind == "labels" and (self.contract.labels != self.labels or self.contract.words != self.verbalizers):
                raise DecisionError("an answer decision's contract must name the decision's labels and answer words")
            if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
                raise DecisionError(f"an answer decision needs max_new_tokens >= 1, not {self.max_new_tokens!r}")
        elif self.contract is not None or self.max_new_tokens is not None:
            raise DecisionError(f"a {self.kind} decision reads log-probs; it has no contract or max_new_tokens")

    def describe(self) -> str:
        """One line for tables: what an application does with the target's output."""
        if self.kind == "calibrated" and self.offsets is None:
            return f"calibrated: {self.positive} when its label log-odds > {self.threshold:.4g} (fitted on train)"
        if self.kind == "calibrated":
            shown = ", ".join(f"{label} {offset:+.3g}" for label, offset in zip(self.labels, self.offsets))
            return f"calibrated: the label with the highest log-prob + offset ({shown}; fitted on train)"
        if self.kind == "argmax":
            return "argmax: the most probable answer word"
        return f"answer: greedy, at most {self.max_new_tokens} new tokens; {self.contract.describe()}"

    def positive_log_odds(self, logprobs: Sequence[float]) -> float:
        """log P(positive) - log P(not positive), over the labels."""
        i = self.labels.index(self.positive)
        others = [lp for j, lp in enumerate(logprobs) if j != i]
        top = max(others)
        return float(logprobs[i]) - (top + math.log(sum(math.exp(lp - top) for lp in others)))

    def parse(self, answer: str | bytes | None, *, truncated: bool = False) -> Parsed:
        """An answer decision's result for one greedy answer: the label, or why the answer broke the contract."""
        if self.kind != "answer":
            raise DecisionError(f"a {self.kind} decision reads label log-probs, not answers")
        return self.contract.parse(answer, truncated=truncated)

    def decide(self, logprobs: Sequence[float]) -> str:
        """The label for one input, from its label log-probs (one per label, in ``labels`` order)."""
        if self.kind == "answer":
            raise DecisionError("an answer decision reads the greedy answer: use parse()")
        if len(logprobs) != len(self.labels) or not all(math.isfinite(lp) for lp in logprobs):
            raise DecisionError(f"expected {len(self.labels)} finite label log-probs, got {list(logprobs)}")
        if self.kind == "argmax":
            return self.labels[max(range(len(self.labels)), key=lambda j: logprobs[j])]
        if self.offsets is not None:
            return self.labels[max(range(len(self.labels)), key=lambda j: logprobs[j] + self.offsets[j])]
        negative = next(label for label in self.labels if label != self.positive)
        return self.positive if self.positive_log_odds(logprobs) > self.threshold else negative

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"kind": self.kind, "labels": list(self.labels), "verbalizers": list(self.verbalizers)}
        if self.kind == "calibrated" and self.offsets is None:
            out.update(positive=self.positive, threshold=self.threshold)
        elif self.kind == "calibrated":
            out.update(offsets=list(self.offsets))
        if self.kind == "answer":
            out.update(contract=self.contract.to_dict(), max_new_tokens=self.max_new_tokens)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DecisionRule":
        if not isinstance(data, Mapping):
            raise DecisionError("a decision record must be a mapping with kind, labels and verbalizers")
        fields = ("kind", "labels", "verbalizers", "positive", "threshold", "contract", "max_new_tokens", "offsets")
        unknown = [k for k in data if k not in fields]
        if unknown:
            raise DecisionError(f"decision record has "
                                f"{unknown_names(unknown, 'unknown field')}; known: {', '.join(fields)}")
        try:
            contract = OutputContract.from_dict(data["contract"]) if data.get("contract") is not None else None
            return cls(data["kind"], tuple(data["labels"]), tuple(data["verbalizers"]), data.get("positive"),
                       data.get("threshold"), contract, data.get("max_new_tokens"), data.get("offsets"))
        except ContractError as exc:
            raise DecisionError(f"decision record's contract: {exc}") from None
        except (KeyError, TypeError) as exc:
            raise DecisionError(f"decision record needs kind, labels and verbalizers: {exc}") from None
