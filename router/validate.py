"""Turns requests into what the workers run: checked token ids and SamplingParams.

Both fronts parse their own format into the plain requests here (`router/grpc_requests.py` from protobuf,
`router/openai_params.py` from OpenAI JSON). Every check raises InvalidRequestError naming the field as the gRPC
client spells it (`sampling.top_p`, `messages[2].role`, ...); the errors map to a status in one place
(router/errors.py).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cluster.messages import WorkerInfo
from engine.errors import InvalidRequestError
from engine.grammar import StructuredOutputSpec, check_spec
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from router.chat_template import ChatOptions
from router.tool_calls import ToolCall, ToolPlan, ToolRequest, plan_tools, template_calls, template_tools

MAX_REQUEST_ID_CHARS = 256
MAX_PROMPT_CHARS = 1 << 20
MAX_MESSAGES = 1024
# NOTE: each stop token id is checked after every generated token and travels in every message to the workers:
# 4M ids cost 82 ms per token and 15 MB per Ray message. vLLM sets no limit; real use is a handful.
MAX_STOP_TOKEN_IDS = 1024
CHAT_ROLES = ("system", "user", "assistant", "tool")
DEFAULT_MAX_TOKENS = 16  # as in vLLM and the OpenAI completions API
# NOTE: a check this small runs on the router's event loop: on the first token's path the hop to a thread and back
# (the thread's wake-up, the GIL's hand-over, the loop's wake-up) took as long as the check itself on 2 cores, as
# long as tokenizing these 512 characters or reading 8k token ids; a longer text, a grammar or tools go to a thread,
# so no check stalls the streams the loop relays
INLINE_CHECK_CHARS = 512
INLINE_CHECK_TOKEN_IDS = 8192
T = TypeVar("T")


def checks_on_loop(text_chars: int, token_ids: int = 0, *, structured: bool = False, tools: bool = False) -> bool:
    """Whether a request with this much text (to tokenize) and these token ids is checked on the event loop."""
    return not structured and not tools and text_chars <= INLINE_CHECK_CHARS and token_ids <= INLINE_CHECK_TOKEN_IDS


async def run_check(on_loop: bool, executor: Executor, check: Callable[[], T]) -> T:
    """`check()` here when `on_loop` (see `checks_on_loop`), else on `executor`."""
    if on_loop:
        return check()
    return await asyncio.get_running_loop().run_in_executor(executor, check)


@dataclass
class SamplingFields:
    """The sampling fields a client sent; None: not set, the default applies."""

    max_tokens: int | None = None  # default DEFAULT_MAX_TOKENS
    temperature: float | None = None  # default 1.0; 0 = greedy
    top_p: float | None = None  # default 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # default: drawn here, so a request samples the same tokens on any worker
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None  # default 1.0 (off)
    min_p: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id → bias in [-100, 100]
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the top k
    prompt_logprobs: int | None = None  # the same for the prompt's tokens
    n: int = 1  # choices sampled from the one prompt
    echo: bool = False  # completions: the prompt comes back before the output (with its logprobs when asked)
    structured: StructuredOutputSpec | None = None  # structured outputs (engine/structured_output.py)
    structured_field: str = "sampling.structured_output"  # where the client set it: errors name it


@dataclass
class PromptRequest:
    """A completion request: a prompt as text or as token ids (one of them)."""

    request_id: str  # "" → the router makes one
    prompt: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    sampling: SamplingFields = field(default_factory=SamplingFields)

    def checks_on_loop(self) -> bool:
        return checks_on_loop(len(self.prompt), len(self.prompt_token_ids),
                              structured=self.sampling.structured is not None)


@dataclass
class ChatTurn:
    """One message of a conversation."""

    role: str  # one of CHAT_ROLES
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)  # an assistant's calls (sent back by the client)
    tool_call_id: str = ""  # a tool message: the call it answers


@dataclass
class MessagesRequest:
    """A chat request: the conversation, rendered with the model's chat template."""

    request_id: str  # "" → the router makes one
    messages: list[ChatTurn]
    sampling: SamplingFields = field(default_factory=SamplingFields)
    tools: ToolRequest | None = None  # tools, tool_choice, parallel_tool_calls (router/tool_calls.py)

    def checks_on_loop(self) -> bool:
        return checks_on_loop(sum(len(m.content) for m in self.messages),
                              structured=self.sampling.structured is not None, tools=self.tools is not None)


@dataclass
class Checked:
    """A request ready to route."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    tools: ToolPlan | None = None  # a chat whose answer's calls are read out of its text (router/tool_stream.py)


class RequestValidator:
    """Checks requests against the model the workers serve (vocabulary, context length, chat template)."""

    def __init__(self, info: WorkerInfo, chat: ChatOptions | None = None) -> None:
        self.info = info
        self.chat_options = chat or ChatOptions()
        self.tokenizer = Tokenizer.from_json(info.tokenizer_json)
        if self.chat_options.template is not None:  # NOTE: router.chat_template replaces the model's own
            self.tokenizer.chat_template = self.chat_options.template
        # NOTE: a prompt longer than this cannot fit the context whatever its tokens: refused before tokenizing
        per_token = self.tokenizer.max_token_chars()
        self.max_prompt_chars = min(MAX_PROMPT_CHARS, (info.max_model_len - 1) * per_token) if per_token \
            else MAX_PROMPT_CHARS

    def precheck(self, prompt_chars: int, prompt_ids: int, messages: int, stop_token_ids: int,
                 rid: str = "") -> None:
        """The size limits, on counts alone: before a request takes an admission slot or is tokenized."""
        if prompt_chars > self.max_prompt_chars:
            raise InvalidRequestError("prompt", f"is {prompt_chars} characters; at most {self.max_prompt_chars} "
                                      "fit the model's context", rid or None)
        if prompt_ids > self.info.max_model_len - 1:
            raise InvalidRequestError("prompt_token_ids", f"is {prompt_ids} tokens; the model takes at most "
                                      f"{self.info.max_model_len - 1}", rid or None)
        if messages > MAX_MESSAGES:
            raise InvalidRequestError("messages", f"at most {MAX_MESSAGES} messages (got {messages})", rid or None)
        if stop_token_ids > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError("sampling.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids (got "
                                      f"{stop_token_ids})", rid or None)

    def prompt(self, req: PromptRequest) -> Checked:
        """A completion request, checked."""
        rid = self._request_id(req.request_id)
        if req.prompt and req.prompt_token_ids:
            raise InvalidRequestError("prompt_token_ids", "set either prompt or prompt_token_ids, not both", rid)
        if req.prompt:
            if len(req.prompt) > self.max_prompt_chars:
                raise InvalidRequestError("prompt", f"is longer than {self.max_prompt_chars} characters (more "
                                          "than the model's context holds)", rid)
            tokens, source = self.tokenizer.encode(req.prompt), "prompt"
        elif req.prompt_token_ids:
            tokens, source = list(req.prompt_token_ids), "prompt_token_ids"
            vocab = self.info.vocab_size
            bad = next((t for t in tokens if t >= vocab), None)
            if bad is not None:
                raise InvalidRequestError(source, f"token id {bad} is not in the vocabulary [0, {vocab})", rid)
        else:
            raise InvalidRequestError("prompt", "must not be empty (set prompt or prompt_token_ids)", rid)
        return Checked(rid, self._check_length(tokens, source, rid), self.sampling(req.sampling, rid))

    def chat(self, req: MessagesRequest) -> Checked:
        """A chat request, checked and rendered with the model's chat template."""
        rid = self._request_id(req.request_id)
        if not req.messages:
            raise InvalidRequestError("messages", "must hold at least one message", rid)
        if len(req.messages) > MAX_MESSAGES:
            raise InvalidRequestError("messages", f"at most {MAX_MESSAGES} messages", rid)
        total = 0
        for i, m in enumerate(req.messages):
            if m.role not in CHAT_ROLES:
                raise InvalidRequestError(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}, "
                                          f"got {m.role!r}", rid)
            total += len(m.content)
        if total > self.max_prompt_chars:
            raise InvalidRequestError("messages", f"contents are longer than {self.max_prompt_chars} characters "
                                      "(more than the model's context holds)", rid)
        s = req.sampling
        plan, spec = plan_tools(req.tools, self.chat_options.tool_call_parser,
                                s.structured_field if s.structured is not None else None, rid)
        if spec is not None:
            s.structured, s.structured_field = spec, "tools"
        turns: list[dict[str, Any]] = [{"role": m.role, "content": m.content} for m in req.messages]
        for i, (m, turn) in enumerate(zip(req.messages, turns, strict=True)):
            if m.tool_calls:
                turn["tool_calls"] = template_calls(m.tool_calls, f"messages[{i}].tool_calls", rid)
            if m.tool_call_id:
                turn["tool_call_id"] = m.tool_call_id
        try:
            text = self.tokenizer.apply_chat_template(turns, tools=template_tools(req.tools))
        except Exception as e:  # noqa: BLE001 - the model's own template may refuse a conversation (raise_exception)
            raise InvalidRequestError("messages", f"the chat template rejected them: {e}", rid) from None
        tokens = self._check_length(self.tokenizer.encode(text), "messages", rid)
        return Checked(rid, tokens, self.sampling(s, rid), plan)

    def sampling(self, s: SamplingFields, request_id: str) -> SamplingParams:
        """The sampling fields as SamplingParams (unset optional fields take the defaults)."""
        max_tokens = s.max_tokens if s.max_tokens is not None else DEFAULT_MAX_TOKENS
        if max_tokens > self.info.max_model_len:
            raise InvalidRequestError("sampling.max_tokens", f"must be at most {self.info.max_model_len} "
                                      "(the model's context length)", request_id)
        if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError("sampling.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids (got "
                                      f"{len(s.stop_token_ids)})", request_id)
        vocab = self.info.vocab_size
        bad = next((t for t in s.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError("sampling.stop_token_ids", f"token id {bad} is not in [0, {vocab})", request_id)
        bad = next((t for t in s.logit_bias if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError("sampling.logit_bias", f"token id {bad} is not in [0, {vocab})", request_id)
        prompt_logprobs = s.prompt_logprobs
        if s.echo and s.logprobs is not None:  # NOTE: echo + logprobs: the prompt's logprobs too (as vLLM)
            prompt_logprobs = max(s.logprobs, prompt_logprobs or 0)
        if s.structured is not None:  # NOTE: builds the grammar (no vocabulary): here, off the router's event loop
            check_spec(s.structured, s.structured_field, request_id)
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=s.temperature if s.temperature is not None else 1.0,
                top_p=s.top_p if s.top_p is not None else 1.0, top_k=s.top_k, seed=s.seed, stop=list(s.stop),
                stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
                presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                repetition_penalty=s.repetition_penalty if s.repetition_penalty is not None else 1.0,
                min_p=s.min_p, logit_bias=dict(s.logit_bias), logprobs=s.logprobs, prompt_logprobs=prompt_logprobs,
                n=s.n, structured=s.structured)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"sampling.{e.field}", e.reason.removeprefix(f"{e.field}: "),
                                      request_id) from None

    def _request_id(self, rid: str) -> str:
        if not rid:
            return f"req-{uuid.uuid4().hex}"
        if len(rid) > MAX_REQUEST_ID_CHARS or not rid.isprintable():
            raise InvalidRequestError("request_id", f"must be printable and at most {MAX_REQUEST_ID_CHARS} characters")
        return rid

    def _check_length(self, tokens: list[int], field: str, rid: str) -> list[int]:
        if not tokens:
            raise InvalidRequestError(field, "must not be empty", rid)
        limit = self.info.max_model_len - 1
        if len(tokens) > limit:
            raise InvalidRequestError(field, f"is {len(tokens)} tokens; the model takes at most {limit} "
                                      "(its context length minus one generated token)", rid)
        return tokens
