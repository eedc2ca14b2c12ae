"""``quality.*``: the options of quality evaluation (harness.quality), apart from it so that
the typed config (harness.config) reads them without importing the engine."""

from __future__ import annotations

from dataclasses import dataclass

from harness.errors import UserError

# The prompt of each evaluated text when a run sets none, for methods that act while
# decoding (h2o, tova, windows) or on every token (quantized caches); a method that
# compresses only a prompt's end gets a longer one (harness/quality_check.py).
DEFAULT_PREFILL = 32


@dataclass
class QualityConfig:
    enabled: bool = False
    text_file: str | None = None  # default: Python's own help texts (pydoc_data.topics)
    num_texts: int = 2
    text_tokens: int = 512
    # Tokens of each text prefilled as its prompt; None: chosen by the method
    # (DEFAULT_PREFILL, or 3/4 of the text for a prompt-time compressor).
    prefill_tokens: int | None = None
    # Also rerun the workload on the reference (quality runs, and every run of a workload
    # with right answers): agreement, output length ratio, right-to-wrong share.
    generation_agreement: bool = True

    def __post_init__(self) -> None:
        if self.num_texts < 1:
            raise UserError(f"quality.num_texts must be >= 1, got {self.num_texts}")
        if self.prefill_tokens is None:
            if self.text_tokens <= DEFAULT_PREFILL:
                raise UserError(f"quality.text_tokens={self.text_tokens}: must exceed the "
                                f"default prompt of {DEFAULT_PREFILL} tokens (or set "
                                "quality.prefill_tokens below it)")
        elif self.text_tokens <= self.prefill_tokens or self.prefill_tokens < 1:
            raise UserError(f"need 1 <= quality.prefill_tokens < quality.text_tokens, got "
                            f"{self.prefill_tokens} and {self.text_tokens}")
