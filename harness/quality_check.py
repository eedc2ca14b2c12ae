"""Whether the quality evaluation sees what a method compresses, and the prompt it uses
(issue #57).

The evaluation streams each text: its first ``prefill`` tokens as a prompt, the rest one
token at a time. A method that compresses a prompt once, at its end, and keeps all it
generates (snapkv without a cap, the kvpress-style presses: knorm, keydiff,
observed_attention, expected_attention; the per-head ones: pyramidkv, adakv,
duo_attention) does nothing to a 32-token prompt: snapkv once
reported a perplexity delta of 0.00, KL 0 and top-1 agreement 1.0 there, silently. So:

* :func:`quality_prefill`: unless ``quality.prefill_tokens`` is set, such a method gets a
  prompt of :data:`PROMPT_SHARE` of the text (longer than its budget; or the shortest it
  compresses, if longer still and the text has room), the others the earlier
  :data:`DEFAULT_PREFILL`; and a prompt (chosen or set) on which the method
  would keep every token of the text is refused before the run, saying what to set;
* :func:`check_evicted`: after the streaming, a method with an eviction policy that gave
  back no more tokens than the exact reference warns loudly (the policy's arithmetic
  below is the plan; what the KV manager counted is the fact).
"""

from __future__ import annotations

import sys
from typing import TypeAlias

from harness.backends.base import KVBackend
from harness.backends.headwise import HeadwiseBackend
from harness.errors import UserError
from harness.kv.policies.base import EvictionPolicy
from harness.kv.policies.budget import BudgetPolicy
from harness.kv.policies.headwise import HeadPolicy
from harness.kv.policies.snapkv import SnapKVPolicy
from harness.kv.policies.window import WindowPolicy
from harness.quality_config import DEFAULT_PREFILL, QualityConfig

PROMPT_SHARE = 0.75  # a prompt-time compressor's prompt: 3/4 of the text (768 of 1024)
MIN_SCORED = 16  # tokens after the prompt, at the least, for a perplexity worth reading

# What decides which tokens a method keeps: a token policy (one table per sequence) or a
# per-head one (a table per layer and KV head); None: the method keeps every token.
Policy: TypeAlias = EvictionPolicy | HeadPolicy | None


def method_policy(backend: KVBackend) -> Policy:
    """``backend``'s policy: its full layers' eviction policy, or its per-head one."""
    if isinstance(backend, HeadwiseBackend):
        return backend.policy
    return backend.full_group_policy()


def compresses_at_prompt_end(policy: Policy) -> bool:
    """A method that compresses a prompt once and then keeps all it generates."""
    if isinstance(policy, HeadPolicy):
        return True
    if isinstance(policy, SnapKVPolicy):
        return not policy.max_tokens
    return isinstance(policy, BudgetPolicy) and not policy.decode_budget


def why_all_kept(policy: Policy, prefill: int, total: int,
                 block_size: int) -> str | None:
    """Why ``policy`` keeps every token of a ``total``-token text whose first ``prefill``
    are the prompt (None: it drops some, or it is no policy the plan knows)."""
    generated = total - prefill
    if isinstance(policy, HeadPolicy):
        if policy.compresses(prefill):
            return None
        return (f"it compresses a prompt once, per head, and keeps all it generates; no "
                f"head gives back a token of a {prefill}-token prompt")
    if isinstance(policy, WindowPolicy):
        # The last forward computes token total - 1; a block goes once that reaches it.
        first = policy.gives_back_at(0, block_size)
        if total - 1 >= first:
            return None
        return (f"its window ({policy.window} tokens + {policy.sinks} sinks, blocks of "
                f"{block_size}) gives a block back only once {first + 1} tokens are held")
    if isinstance(policy, SnapKVPolicy):
        keep = policy.keep(prefill)
        capped = policy.max_tokens and keep + generated > policy.max_tokens
        if keep < prefill or capped:
            return None
        return (f"it compresses a prompt at its end to its window ({policy.window}) + its "
                f"budget and keeps {keep} of the {prefill} prompt tokens: all of them")
    if isinstance(policy, BudgetPolicy):
        if policy.decode_budget:
            budget = policy.budget(prefill, generated)
            if budget < total:
                return None
            return f"its budget ({budget} tokens per sequence) holds all {total} tokens"
        keep = policy.keep(prefill)
        if keep < prefill:
            return None
        return (f"it compresses a prompt at its end and keeps all it generates; of the "
                f"{prefill} prompt tokens it keeps {keep}: all of them")
    return None


def _shortest_compressed(policy: EvictionPolicy | HeadPolicy,
                         block_size: int) -> int | None:
    """The shortest prompt a prompt-time compressor shortens (None: none up to 64k)."""
    p = 2
    while p <= 1 << 16:
        if why_all_kept(policy, p, p + MIN_SCORED, block_size) is None:
            return p
        p = p + 1 if p < 256 else p + p // 16
    return None


def quality_prefill(qc: QualityConfig, policy: Policy, backend: str,
                    block_size: int) -> int:
    """The prompt length of the quality evaluation for a run whose backend keeps tokens
    by ``policy`` (its full layers' policy; None: it evicts nothing). Raises a UserError
    before the run where the method would keep every token of the evaluated text."""
    total = qc.text_tokens
    if qc.prefill_tokens is not None:
        prefill, how = qc.prefill_tokens, f"quality.prefill_tokens={qc.prefill_tokens}"
    elif compresses_at_prompt_end(policy):
        assert policy is not None
        prefill = min(total - MIN_SCORED, max(DEFAULT_PREFILL, int(PROMPT_SHARE * total)))
        # A method that keeps more than 3/4 of the text gets the shortest prompt it
        # compresses, where the text has room for it.
        shortest = _shortest_compressed(policy, block_size)
        if shortest is not None and prefill < shortest <= total - MIN_SCORED:
            prefill = shortest
        how = f"the prompt it gets by default ({prefill} tokens)"
    else:
        prefill, how = DEFAULT_PREFILL, f"the default prompt ({DEFAULT_PREFILL} tokens)"
    why = why_all_kept(policy, prefill, total, block_size)
    if why is None:
        return prefill
    fix = "a longer quality.text_tokens"
    if compresses_at_prompt_end(policy):
        assert policy is not None
        shortest = _shortest_compressed(policy, block_size)
        if shortest is not None:
            fix = (f"a prompt of at least {shortest} tokens (quality.prefill_tokens="
                   f"{shortest} or more, below quality.text_tokens; or leave it unset "
                   f"with quality.text_tokens>={int(shortest / PROMPT_SHARE) + 1})")
    raise UserError(f"quality: backend {backend} would keep every token of the evaluated "
                    f"text ({total} tokens, {how}): {why}; its quality.* figures would "
                    f"show no compression at all (perplexity delta 0, KL 0). Use {fix}, "
                    "or a smaller budget")


def check_evicted(backend: str, policy: Policy, evicted_per_seq: float,
                  prefill: int) -> None:
    """Warn loudly when a method with an eviction policy gave back no token of the
    evaluated text beyond what the exact reference did (``evicted_per_seq``)."""
    if policy is None or evicted_per_seq > 0:
        return
    print(f"kvbench: WARNING: quality: backend {backend} gave back no token of the "
          f"evaluated text ({prefill}-token prompt, then one token at a time): its "
          "quality.* figures measure no compression (quality.evicted_tokens_per_seq=0); "
          "see docs/metrics.md, Quality evaluation", file=sys.stderr)
