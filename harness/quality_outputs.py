"""What compression does to the outputs themselves (issue #57), against the exact
reference's outputs on the same prompts (greedy, EOS honoured as the workload asks):

- ``quality.output_length_ratio``: the method's mean output tokens over the reference's,
  on the requests both ran. Compressed caches were found to make answers longer (arXiv
  2503.24000, 2512.12008). Absent, not 1.0, where the workload fixes output lengths (every
  request ignores EOS: both sides then write the same count by construction);
- ``quality.right_to_wrong_share``: of the task prompts both ran, the share the reference
  answers right (full marks) and the method does not. Only for workloads with right
  answers (``ruler``); the accuracy difference hides it when the method also turns
  some wrong answers right.
"""

from __future__ import annotations

from collections.abc import Callable

from harness.metrics.tasks import ScoresTasks
from harness.model.tokenizer import Tokenizer
from harness.workloads.base import Workload


def lengths_fixed(workload: Workload) -> bool:
    """Whether the workload fixes every output's length (every request ignores EOS; a
    ``stop_after`` length then stops it as the workload drew)."""
    requests = workload.initial_requests()
    return bool(requests) and all(r.params.ignore_eos for r in requests)


def output_length_ratio(outputs: dict[int, list[int]],
                        reference: dict[int, list[int]]) -> float | None:
    """Mean output tokens of ``outputs`` over ``reference``'s, on the request ids both
    have (None: none, or the reference wrote nothing)."""
    common = sorted(set(outputs) & set(reference))
    ref_total = sum(len(reference[r]) for r in common)
    if not common or ref_total == 0:
        return None
    return sum(len(outputs[r]) for r in common) / ref_total


def right_to_wrong_share(scores: dict[int, float],
                         reference: dict[int, float]) -> float | None:
    """The share of the request ids both scored that the reference answers right (score
    1: every expected string) and ``scores`` does not (None: none in common)."""
    common = set(scores) & set(reference)
    if not common:
        return None
    return sum(reference[r] >= 1.0 > scores[r] for r in common) / len(common)


def _scores(workload: ScoresTasks, outputs: dict[int, list[int]],
            tok: Tokenizer) -> dict[int, float]:
    return {r: float(workload.score(r, tok.decode(ids))) for r, ids in outputs.items()}


def output_metrics(workload: Workload, tok: Tokenizer, outputs: dict[int, list[int]],
                   reference: dict[int, list[int]],
                   fixed: Callable[[], bool]) -> dict[str, float]:
    """The two keys (module docstring) for a run's ``outputs`` against the reference's;
    ``fixed`` says whether the workload fixes output lengths (asked only when needed)."""
    m: dict[str, float] = {}
    if not fixed():
        ratio = output_length_ratio(outputs, reference)
        if ratio is not None:
            m["quality.output_length_ratio"] = ratio
    if isinstance(workload, ScoresTasks):
        share = right_to_wrong_share(_scores(workload, outputs, tok),
                                     _scores(workload, reference, tok))
        if share is not None:
            m["quality.right_to_wrong_share"] = share
    return m
