"""``quality.*``: the options of quality evaluation (harness.quality), apart from it so that
the typed config (harness.config) reads them without importing the engine."""

from __future__ import annotations

from dataclasses import dataclass

from harness.errors import UserError


@dataclass
class QualityConfig:
    enabled: bool = False
    text_file: str | None = None  # default: Python's own help texts (pydoc_data.topics)
    num_texts: int = 2
    text_tokens: int = 512
    prefill_tokens: int = 32
    generation_agreement: bool = True  # also rerun the workload on the reference

    def __post_init__(self) -> None:
        if self.num_texts < 1:
            raise UserError(f"quality.num_texts must be >= 1, got {self.num_texts}")
        if self.text_tokens <= self.prefill_tokens or self.prefill_tokens < 1:
            raise UserError(f"need 1 <= quality.prefill_tokens < quality.text_tokens, got "
                            f"{self.prefill_tokens} and {self.text_tokens}")
