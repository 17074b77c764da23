"""Per-request sampling settings, validated where they are made."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.grammar import StructuredOutputSpec, check_spec

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop; temperature 0 means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    # NOTE: 0 or -1 disables top-k, as in vLLM.
    top_k: int = 0
    # NOTE: None draws a seed at creation, so a request samples the same tokens wherever it runs.
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # NOTE: a request continued elsewhere after a failure (prompt + the tokens it already produced) keeps drawing
    # from its own random stream: its first new token is output number `output_offset` of the original request.
    output_offset: int = 0
    # Structured outputs (engine/structured_output.py): the output follows this JSON schema / regex / choice / grammar.
    structured: StructuredOutputSpec | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.seed is None:
            self.seed = secrets.randbits(63)
        self.validate()

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise InvalidRequestError("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0 or self.temperature != self.temperature:
            raise InvalidRequestError("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequestError("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise InvalidRequestError("seed", f"must be an integer in [0, 2**64), got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_LEN:
                raise InvalidRequestError("stop", f"each stop string must be 1..{MAX_STOP_STRING_LEN} characters")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise InvalidRequestError("stop_token_ids", f"must be non-negative integers, got {t!r}")
        if self.structured is not None:
            check_spec(self.structured, "structured")
            if self.ignore_eos:  # NOTE: a grammar's output ends at an EOS token; ignoring it would never end
                raise InvalidRequestError("ignore_eos", "cannot be combined with structured outputs")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
