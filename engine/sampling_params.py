"""Per-request sampling settings, validated where they are made."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.grammar import StructuredOutputSpec, check_spec_shape

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_LOGPROBS = 20  # top logprobs per token at most (vLLM's default max_logprobs, OpenAI's top_logprobs limit)
MAX_N = 16  # sequences per request at most
MAX_LOGIT_BIAS = 300  # entries of logit_bias at most (OpenAI's limit)


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
    # Penalties and filters, defined as vLLM defines them (engine/sampler.py applies them)
    presence_penalty: float = 0.0  # subtracted from the logit of every token the output holds, in [-2, 2]
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output, in [-2, 2]
    repetition_penalty: float = 1.0  # tokens of prompt or output: positive logits divided, negative multiplied
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one, in [0, 1]
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id → added to its logit, in [-100, 100]
    # NOTE: None: no logprobs; k >= 0: the sampled token's logprob and the k most likely (vLLM's processed
    # logprobs: after logit_bias, a grammar's mask and the penalties, before temperature and the filters).
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token (the first has none)
    n: int = 1  # sequences sampled from one prompt; sequence i draws from the stream of seed + i
    # Structured outputs (engine/structured_output.py): the output follows this JSON schema / regex / choice / grammar.
    structured: StructuredOutputSpec | None = None
    # NOTE: the LoRA adapter (its name, loaded by LLMEngine.load_lora) this request runs with; None: the base model.
    # Here rather than beside the request so that it travels wherever the params go (forks, a resumed request).
    lora: str | None = None

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler needs the row's token history (any penalty set)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

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
            error = check_spec_shape(self.structured)
            if error is not None:
                raise InvalidRequestError("structured", error)
            if self.ignore_eos:  # NOTE: a grammar's output ends at an EOS token; ignoring it would never end
                raise InvalidRequestError("ignore_eos", "cannot be combined with structured outputs")
        self._validate_extras()

    def _validate_extras(self) -> None:
        """The penalties, filters, logprobs and n (vLLM's ranges)."""
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise InvalidRequestError(name, f"must be in [-2, 2], got {v}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidRequestError("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for t, b in self.logit_bias.items():
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise InvalidRequestError("logit_bias", f"keys must be token ids (non-negative integers), got {t!r}")
            if not -100.0 <= b <= 100.0:
                raise InvalidRequestError("logit_bias", f"values must be in [-100, 100], got {b} for token {t}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_LOGPROBS):
                raise InvalidRequestError(name, f"must be in [0, {MAX_LOGPROBS}], got {v!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise InvalidRequestError("n", f"must be in [1, {MAX_N}], got {self.n!r}")
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise InvalidRequestError("lora", f"must be an adapter's name (a non-empty string) or None, got "
                                              f"{self.lora!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
