"""Quality of a backend against the exact reference, on real text, through the engine.

Teacher-forced streaming evaluation: each text's first ``prefill`` tokens are prefilled,
then every following true token is fed one at a time through the engine's decode path
with the backend under test, so quantization and eviction act as they do while
generating. The prompt is long enough for the method to act on it (a prompt-time
compressor gets 3/4 of the text), and a setting on which it would keep every token is
refused before the run (harness/quality_check.py). The same texts run through the exact
reference (contiguous storage, fp32). Reported: perplexity of both and its delta, mean
KL(reference || backend) of the next-token distributions, and top-1 agreement. Several
texts run as concurrent sequences.

Also, for workload runs, greedy-generation agreement: per request, how many generated
tokens match the reference backend's before the first divergence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from harness.backends.base import BackendOptions
from harness.backends.contiguous import ContiguousOptions
from harness.backends.paged import PagedOptions
from harness.engine.sampler import Sampler, make_sampler
from harness.errors import UserError
from harness.metrics.bootstrap import ci_keys
from harness.metrics.summary import kv_read_bytes_per_token
from harness.model import LoadedModel, load_model
from harness.quality_check import Policy, check_evicted, method_policy
from harness.quality_config import DEFAULT_PREFILL, QualityConfig
from harness.quality_outputs import lengths_fixed, output_metrics
from harness.sched.sequence import SamplingParams, Sequence, SequenceGroup
from harness.stack import build_stack
from harness.workloads import make_workload
from harness.workloads.base import Request, Workload
from harness.workloads.text import corpus_text

if TYPE_CHECKING:
    from harness.config import RunConfig

# The exact reference every backend is scored against: its own reservation per sequence,
# nothing shared, nothing evicted, fp32 (reference_model).
REFERENCE = ContiguousOptions(name="contiguous", reserve="exact")
# A hybrid-attention model's reference attends each layer through its window (KV cache
# groups, backends.base.LayerSlot), which contiguous storage does not: exact paged then.
HYBRID_REFERENCE = PagedOptions(name="paged", kernel="torch")


def reference_backend(loaded: LoadedModel) -> BackendOptions:
    """The exact reference for ``loaded``: :data:`REFERENCE`, or for a model whose layers
    differ in attention :data:`HYBRID_REFERENCE`."""
    return HYBRID_REFERENCE if loaded.config.layer_attention else REFERENCE


def load_texts(cfg: QualityConfig, loaded: LoadedModel) -> list[list[int]]:
    """``num_texts`` consecutive, disjoint windows of ``text_tokens`` tokens (no BOS)."""
    text = read_text_file(Path(cfg.text_file)) if cfg.text_file else corpus_text()
    want = cfg.num_texts * cfg.text_tokens
    ids = loaded.tokenizer.encode(text[: want * 8], add_bos=False)
    if len(ids) < want:
        raise UserError(f"the text has {len(ids)} tokens; quality.num_texts x "
                         f"quality.text_tokens needs {want}: use a longer quality.text_file "
                         "or smaller lengths")
    return [ids[i * cfg.text_tokens:(i + 1) * cfg.text_tokens] for i in range(cfg.num_texts)]


def read_text_file(path: Path) -> str:
    """A UTF-8 text file, or a UserError saying why not: a perplexity over replacement
    characters (a binary file read leniently once gave 5514) is a wrong number, not a
    measurement."""
    if path.is_dir():
        raise UserError(f"quality.text_file={path} is a folder; give a UTF-8 text file")
    if not path.is_file():
        raise UserError(f"quality.text_file={path} does not exist")
    data = path.read_bytes()
    if b"\x00" in data[:8192]:
        raise UserError(f"quality.text_file={path} looks binary (NUL bytes): give a UTF-8 "
                        "text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"quality.text_file={path} is not UTF-8 ({e.reason} at byte "
                        f"{e.start}): convert it, e.g. iconv -t utf-8") from None


class _TextsWorkload:
    name = "quality"

    def __init__(self, texts: list[list[int]], prefill: int) -> None:
        self.texts, self.prefill = texts, prefill

    def initial_requests(self) -> list[Request]:
        params = SamplingParams(max_tokens=len(self.texts[0]) - self.prefill, ignore_eos=True)
        return [Request(i, t[:self.prefill], params) for i, t in enumerate(self.texts)]

    def on_finished(self, group: SequenceGroup) -> list[Request]:
        return []


class ForcedSampler(Sampler):
    """Feeds the true next token and scores the distribution the model gave for it.

    Reference mode keeps every log-prob row; compare mode computes, against those rows,
    KL(reference || backend) and top-1 agreement as it goes."""

    def __init__(self, texts: list[list[int]], prefill: int,
                 reference: torch.Tensor | None = None) -> None:
        super().__init__(0)
        self.texts, self.prefill = texts, prefill
        self.reference = reference
        self.kept: dict[tuple[int, int], torch.Tensor] = {}
        self.nll = 0.0
        self.kl = 0.0
        self.agree = 0
        self.count = 0
        # Per token, keyed (text, step): the bootstrap pairs the backend's token with the
        # reference's, whatever order the batches scored them in.
        self.token_nll: dict[tuple[int, int], float] = {}
        self.token_kl: dict[tuple[int, int], float] = {}

    def sample(self, logits: torch.Tensor, seqs: list[Sequence],
               samples: list[int | None] | None = None) -> list[int]:
        lp = torch.log_softmax(logits.float(), dim=-1)
        out = []
        for row, seq in zip(lp, seqs):
            text = self.texts[seq.group.request_id]
            pos = len(seq.token_ids)  # the row predicts token `pos`
            true = text[pos]
            nll = -float(row[true])
            self.nll += nll
            self.count += 1
            i = pos - self.prefill
            self.token_nll[(seq.group.request_id, i)] = nll
            if self.reference is None:
                self.kept[(seq.group.request_id, i)] = row
            else:
                ref = self.reference[seq.group.request_id, i]
                kl = float((ref.exp() * (ref - row)).sum())
                self.kl += kl
                self.token_kl[(seq.group.request_id, i)] = kl
                self.agree += int(int(ref.argmax()) == int(row.argmax()))
            out.append(true)
        return out

    def stacked(self) -> torch.Tensor:
        n, steps = len(self.texts), len(self.texts[0]) - self.prefill
        return torch.stack([torch.stack([self.kept[(t, i)] for i in range(steps)])
                            for t in range(n)])


@dataclass
class Streamed:
    """What one streaming of the texts held and read, and what its policy gave back."""

    held_mean: float  # KV bytes held per sequence, mean over steps
    held_peak: float  # ... and the peak
    reads: float | None  # cache bytes a decode query read (the backend's declared reads)
    evicted_tokens: int  # tokens the KV manager's eviction policies gave back, all texts
    policy: Policy  # what decides what the backend keeps (quality_check.method_policy)


def _stream(loaded: LoadedModel, device: torch.device, backend: BackendOptions,
            rc: RunConfig, sampler: ForcedSampler, texts: list[list[int]],
            prefill: int, budget: str | int) -> Streamed:
    """Stream the texts through a stack of ``backend``."""
    st = build_stack(loaded, device, backend, rc.cache.without_tiers(), rc.scheduler, sampler,
                     quiet=True, kv_budget=budget)
    st.engine.run(_TextsWorkload(texts, prefill))
    per_seq = [s.reserved_bytes / s.running for s in st.collector.steps if s.running]
    reads = kv_read_bytes_per_token(st.collector.steps)
    mean = sum(per_seq) / len(per_seq) if per_seq else 0.0
    return Streamed(mean, max(per_seq, default=0.0), reads, st.kv.stats.evicted_tokens,
                    method_policy(st.backend))


def fp32_bytes_per_token(loaded: LoadedModel) -> int:
    c = loaded.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4


def reference_model(loaded: LoadedModel, rc: RunConfig, device: torch.device) -> LoadedModel:
    """The exact reference runs in fp32: the run's own model if it is fp32."""
    if next(loaded.model.parameters()).dtype == torch.float32:
        return loaded
    return load_model(rc.model.source, rc.model.path, torch.float32, device)


def evaluate_quality(loaded: LoadedModel, device: torch.device, rc: RunConfig,
                     texts: list[list[int]] | None = None,
                     prefill: int | None = None) -> dict[str, float]:
    """Perplexity, KL and top-1 agreement of the run's backend against :data:`REFERENCE`
    on the evaluation texts (``texts``: from :func:`load_texts`, loaded up front by the
    runner so that a bad quality.* setting fails before the workload runs), each text's
    first ``prefill`` tokens its prompt (from :func:`harness.quality_check.
    quality_prefill`, chosen when the run's stack was built; None: quality.prefill_tokens,
    else the default)."""
    qc = rc.quality
    if texts is None:
        texts = load_texts(qc, loaded)
    if prefill is None:
        prefill = qc.prefill_tokens if qc.prefill_tokens is not None else DEFAULT_PREFILL
    ref_model = reference_model(loaded, rc, device)
    # Budgets: the reference holds every text whole; the backend gets the run's budget.
    ref_budget = fp32_bytes_per_token(ref_model) * (qc.text_tokens + 16) * len(texts) * 2
    ref = ForcedSampler(texts, prefill)
    ref_run = _stream(ref_model, device, reference_backend(ref_model), rc, ref, texts,
                      prefill, ref_budget)
    test = ForcedSampler(texts, prefill, reference=ref.stacked())
    run = _stream(loaded, device, rc.backend, rc, test, texts, prefill, rc.cache.kv_budget)
    # What the method gave back beyond the reference (a hybrid model's reference gives
    # back its sliding layers' old tokens too).
    evicted = (run.evicted_tokens - ref_run.evicted_tokens) / len(texts)
    check_evicted(rc.backend.name, run.policy, evicted, prefill)
    ppl_ref = math.exp(ref.nll / ref.count)
    ppl = math.exp(test.nll / test.count)
    held_mean, held_peak, reads = run.held_mean, run.held_peak, run.reads
    return {
        "quality.ppl": ppl,
        "quality.ppl_ref": ppl_ref,
        "quality.ppl_delta_pct": 100.0 * (ppl - ppl_ref) / ppl_ref,
        "quality.kl_mean": test.kl / test.count,
        "quality.top1_agreement": test.agree / test.count,
        "quality.tokens": float(test.count),
        "quality.prefill_tokens": float(prefill),
        # Tokens of each text the method's eviction gave back: 0 for a method that kept
        # everything (then warned about), or that evicts nothing by design.
        "quality.evicted_tokens_per_seq": evicted,
        # KV memory one streamed sequence held (all its blocks): what the backend buys.
        "quality.kv_bytes_per_seq_mean": held_mean,
        "quality.kv_bytes_per_seq_peak": held_peak,
        # ... and what each streamed token's attention read of it (quest reads less).
        **({"quality.kv_read_bytes_per_token": reads} if reads is not None else {}),
        **quality_intervals(test, ref, rc.seed),
    }


# Consecutive tokens' losses are correlated: resample runs of this many tokens together.
TOKEN_BLOCK = 32


def _ppl_delta_pct(pairs: np.ndarray) -> float:
    # pairs: rows (backend nll, reference nll) of the same tokens.
    ppl, ref = np.exp(pairs.mean(axis=0))
    return float(100.0 * (ppl - ref) / ref)


def quality_intervals(test: ForcedSampler, ref: ForcedSampler, seed: int) -> dict[str, float]:
    """Bootstrap 95% intervals of quality.ppl_delta_pct and quality.kl_mean over the
    streamed tokens (moving blocks of :data:`TOKEN_BLOCK`, tokens in text order)."""
    keys = sorted(test.token_nll)
    pairs = np.array([[test.token_nll[k], ref.token_nll[k]] for k in keys])
    kls = np.array([test.token_kl[k] for k in keys])
    return {**ci_keys("quality.ppl_delta_pct", pairs, _ppl_delta_pct, seed=seed,
                      block=TOKEN_BLOCK),
            **ci_keys("quality.kl_mean", kls, seed=seed, block=TOKEN_BLOCK)}


def reference_outputs(loaded: LoadedModel, device: torch.device, rc: RunConfig,
                      capacity: int) -> dict[int, list[int]]:
    """Rerun the workload on :data:`REFERENCE`: its output ids by request id (requests
    pair by id, which the workload derives from what a request is, never from scheduling
    order)."""
    ref_model = reference_model(loaded, rc, device)
    workload = make_workload(rc.workload, ref_model.tokenizer)
    budget = fp32_bytes_per_token(ref_model) * max(2 * capacity, 4096)
    st = build_stack(ref_model, device, reference_backend(ref_model),
                     rc.cache.without_tiers(), rc.scheduler, make_sampler(rc.seed, device),
                     quiet=True, kv_budget=budget)
    st.engine.run(workload)
    return st.collector.outputs()


def generation_agreement(loaded: LoadedModel, device: torch.device, rc: RunConfig,
                         outputs: dict[int, list[int]], capacity: int) -> dict[int, int]:
    """Rerun the workload on :data:`REFERENCE` and count, per request, the generated tokens
    equal to the reference's before the first difference."""
    return agreement(outputs, reference_outputs(loaded, device, rc, capacity))


@dataclass
class QualityResult:
    """Every quality.* metric of a run, and per request the agreeing token count."""

    metrics: dict[str, float] = field(default_factory=dict)
    agree_tokens: dict[int, int] = field(default_factory=dict)


def measure(loaded: LoadedModel, device: torch.device, rc: RunConfig,
            texts: list[list[int]] | None, outputs: dict[int, list[int]],
            capacity: int, prefill: int | None = None,
            workload: Workload | None = None) -> QualityResult:
    """The run's quality. With quality.enabled: streamed-text scores (each text's first
    ``prefill`` tokens its prompt). With quality.generation_agreement (the default), for
    a quality run or a workload with right answers (``workload``, the run's): the workload
    rerun on the reference, its agreement keys (quality runs) and the output keys of
    harness/quality_outputs.py (output length ratio, right-to-wrong share)."""
    qc = rc.quality
    res = QualityResult(evaluate_quality(loaded, device, rc, texts, prefill)
                        if qc.enabled else {})
    if not qc.generation_agreement:
        return res
    ref = reference_outputs(loaded, device, rc, capacity)
    if qc.enabled:
        agree = agreement(outputs, ref)
        res.agree_tokens = agree
        n = len(agree)
        res.metrics["quality.gen_agree_tokens_mean"] = sum(agree.values()) / n if n else 0.0
        res.metrics["quality.gen_exact_match_rate"] = (
            sum(agree[r] == len(outputs[r]) for r in agree) / n if n else 0.0)
    tok = loaded.tokenizer
    wl = workload if workload is not None else make_workload(rc.workload, tok)
    # A fresh workload to read the requests' params from: the run's has been consumed.
    res.metrics.update(output_metrics(wl, tok, outputs, ref,
                                      lambda: lengths_fixed(make_workload(rc.workload, tok))))
    return res


def agreement(outputs: dict[int, list[int]], ref: dict[int, list[int]]) -> dict[int, int]:
    """Per request: generated tokens equal to the reference's before the first difference."""
    out = {}
    for rid, toks in outputs.items():
        other = ref.get(rid, [])
        n = 0
        for a, b in zip(toks, other):
            if a != b:
                break
            n += 1
        out[rid] = n
    return out
