"""The production decision: how an application turns the target model's output into a label.

A decision rule ships with each template version (inside its record, so it is as immutable as the text and
part of its content hash), and the serving API applies it (``templates.serving.TemplateReader.predict``).
The held-out figures a version records are the figures of this rule, computed by the same function.

Two kinds, as the task file declares (``scoring.decision``):

* ``calibrated``: the target's label log-probabilities (normalised over the labels' answer words) with a
  threshold on the positive label's log-odds, fitted on the train split. An application needs the log-probs
  and this threshold; both come with the version.
* ``argmax``: the label whose answer word is most probable. No fitted value.
* ``answer``: the target's greedy answer (at most ``max_new_tokens`` new tokens), parsed by the output
  contract (``templates.contract``): an answer that breaks it is a failure, which the application sees as such.

Pure: no model, no I/O. Log-probs or an answer in, a label (or a failed parse) out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from templates.contract import ContractError, OutputContract, Parsed

KINDS = ("calibrated", "argmax", "answer")


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", tuple(self.labels))
        object.__setattr__(self, "verbalizers", tuple(self.verbalizers))
        if self.kind not in KINDS:
            raise DecisionError(f"decision kind {self.kind!r} is not one of {list(KINDS)}")
        if len(self.labels) < 2 or len(self.labels) != len(self.verbalizers) or len(set(self.labels)) != len(self.labels):
            raise DecisionError(f"a decision needs two or more distinct labels, each with its answer word; got "
                                f"labels {list(self.labels)} and answer words {list(self.verbalizers)}")
        if self.kind == "calibrated":
            if len(self.labels) != 2 or self.positive not in self.labels:
                raise DecisionError("a calibrated decision takes two labels and names the positive one")
            if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or not math.isfinite(self.threshold):
                raise DecisionError(f"a calibrated decision needs a finite threshold, not {self.threshold!r}")
        elif self.positive is not None or self.threshold is not None:
            raise DecisionError(f"an {self.kind} decision has no positive label and no threshold")
        if self.kind == "answer":
            if not isinstance(self.contract, OutputContract):
                raise DecisionError("an answer decision needs its output contract")
            if self.contract.kind == "labels" and (self.contract.labels != self.labels or self.contract.words != self.verbalizers):
                raise DecisionError("an answer decision's contract must name the decision's labels and answer words")
            if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
                raise DecisionError(f"an answer decision needs max_new_tokens >= 1, not {self.max_new_tokens!r}")
        elif self.contract is not None or self.max_new_tokens is not None:
            raise DecisionError(f"a {self.kind} decision reads log-probs; it has no contract or max_new_tokens")

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
        negative = next(label for label in self.labels if label != self.positive)
        return self.positive if self.positive_log_odds(logprobs) > self.threshold else negative

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"kind": self.kind, "labels": list(self.labels), "verbalizers": list(self.verbalizers)}
        if self.kind == "calibrated":
            out.update(positive=self.positive, threshold=self.threshold)
        if self.kind == "answer":
            out.update(contract=self.contract.to_dict(), max_new_tokens=self.max_new_tokens)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DecisionRule":
        if not isinstance(data, Mapping):
            raise DecisionError("a decision record must be a mapping with kind, labels and verbalizers")
        unknown = sorted(set(data) - {"kind", "labels", "verbalizers", "positive", "threshold", "contract",
                                      "max_new_tokens"})
        if unknown:
            raise DecisionError(f"decision record has unknown field(s) {unknown}")
        try:
            contract = OutputContract.from_dict(data["contract"]) if data.get("contract") is not None else None
            return cls(data["kind"], tuple(data["labels"]), tuple(data["verbalizers"]), data.get("positive"),
                       data.get("threshold"), contract, data.get("max_new_tokens"))
        except ContractError as exc:
            raise DecisionError(f"decision record's contract: {exc}") from None
        except (KeyError, TypeError) as exc:
            raise DecisionError(f"decision record needs kind, labels and verbalizers: {exc}") from None
