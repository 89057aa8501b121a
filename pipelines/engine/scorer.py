"""What a label scorer is: the seam between the scoring code (``pipelines.scoring``, ``templates.serving``) and a
target or judge model.

Implemented by ``LabelScorer`` (a model in this process, ``pipelines/engine/target.py``), ``EndpointLabelScorer``
(a model behind an OpenAI-compatible server, ``pipelines/engine/endpoints.py``), ``Metered`` (one role's view of
either, counting its calls, ``pipelines/engine/usage.py``) and ``CountingModel`` (a stand-in that answers at once
and counts what a model would be asked, ``pipelines/budget.py``). A structural type: they do not inherit from it.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import numpy as np
import numpy.typing as npt

from pipelines.engine.answers import Answer
from pipelines.engine.usage import Usage
from templates.template import Template


class Scorer(Protocol):
    @property
    def verbalizers(self) -> list[str]:
        """The label words read, in label order: ``score``'s columns."""
        ...

    @property
    def usage(self) -> Usage:
        """Calls and tokens answered so far (cumulative; a cached pair is free)."""
        ...

    def score(self, template: Template, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """Label log-probs normalised over the labels, shape (len(texts), len(verbalizers))."""
        ...

    def answer(self, template: Template, texts: Sequence[str], max_new_tokens: int,
               complete: Callable[[str], bool] | None = None) -> list[Answer]:
        """The greedy answer to each prompt, at most ``max_new_tokens`` new tokens; ``complete(text)`` True may
        stop an answer early (its parse is settled)."""
        ...

    def request_latency_ms(self, template: Template, texts: Sequence[str], n: int = 12) -> dict[str, float]:
        """What a service sees, one request at a time on the first ``n`` texts: ``p50`` and ``p95`` in ms over
        the requests that succeeded, and ``error_rate``."""
        ...
