"""The `router:` section of the deploy config: the front door clients call, and how it renders chats."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

if TYPE_CHECKING:
    from router.settings import RouterSettings

EventLoop = Literal["auto", "uvloop", "asyncio"]  # the router process's loop (pdcluster/event_loop.py runs it)


class RouterConfig(BaseModel):
    """The gRPC front door that clients call."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field(default="127.0.0.1", min_length=1, description="address to bind; 0.0.0.0 serves other machines")
    port: int = Field(default=50051, ge=0, le=65535, description="port to bind; 0 picks a free one")
    routing: Literal["prefix_aware", "round_robin"] = Field(default="prefix_aware", description="how decode is picked")
    max_inflight: int = Field(default=256, gt=0, description="concurrent requests; more get RESOURCE_EXHAUSTED")
    skip_prefill_max_uncached_tokens: int = Field(
        default=64, ge=0, description="a decode worker caching all but this many prompt tokens prefills them (0: off)")
    request_timeout_s: float = Field(default=600.0, gt=0, description="a request not finished by then fails")
    prefill_timeout_s: float = Field(default=120.0, gt=0, description="a prefill not back by then is retried "
                                     "on another prefill worker")
    slo_ttft_ms: float = Field(default=2000.0, gt=0, description="time-to-first-token target (ms); admission refuses "
                               "requests predicted past max_predicted_ttft_ms (null: 4 × this)")
    slo_itl_ms: float | None = Field(default=100.0, gt=0, description="inter-token latency target (ms): every "
                                     "engine's steps take prompt tokens beside decoding only within it, and the router "
                                     "places prompts on decode workers (or keeps requests on prefill workers) by it; "
                                     "null: neither")
    max_predicted_ttft_ms: float | None = Field(default=None, ge=0, description="a request whose first token is "
                                                "predicted later is refused (RESOURCE_EXHAUSTED); null: 4 × "
                                                "slo_ttft_ms; 0: no limit")
    stall_timeout_steps: float = Field(default=100.0, gt=0, description="a decode stream with no token for this many "
                                       "of its worker's usual steps fails over, as if the worker died")
    stall_timeout_min_s: float = Field(default=15.0, gt=0, description="... and never sooner than this (seconds)")
    client_stall_timeout_s: float = Field(default=30.0, gt=0, description="a streaming client that reads nothing "
                                          "this long while its buffer is full is cut off and its request aborted")
    stream_buffer_chunks: int = Field(default=16, ge=1, le=4096, description="chunks buffered per stream in the "
                                      "router, and unread deltas per decode stream before the worker pauses it")
    stream_interval: int = Field(default=1, ge=1, le=4096, description="tokens per streamed chunk (vLLM's and "
                                 "SGLang's --stream-interval): a stream's tokens go to its client once this many are "
                                 "there (the first at once, the last with the finish); 1 sends each token as made, "
                                 "more cut the router's CPU per token (one write per chunk) at the cost of burstier "
                                 "streams")
    event_loop: EventLoop = Field(
        default="auto", description="the router process's event loop (uvicorn's --loop): uvloop runs the loop's own "
        "work per token in C (less CPU per streamed token); auto: uvloop where it is installed, else asyncio")
    lease_s: float = Field(default=8.0, ge=1, description="a worker aborts a request (freeing its KV blocks) that no "
                           "live router renewed for this long (a router renews every quarter of it)")
    chat_template: str | None = Field(default=None, min_length=1, description="the chat template chats are rendered "
                                      "with (vLLM's --chat-template): a shipped one by name (smollm2_hermes: "
                                      "SmolLM2's with tools) or a Jinja file; null: the model's own")
    tool_call_parser: Literal["hermes", "llama3_json"] | None = Field(
        default=None, description="how tool calls are read out of the model's text for tool_choice 'auto' (vLLM's "
        "names); null: 'auto' with tools is refused ('required' and named functions need no parser)")

    @field_validator("chat_template")
    @classmethod
    def _template_readable(cls, value: str | None) -> str | None:
        if value is not None:
            from router.chat_template import load_chat_template

            load_chat_template(value)  # NOTE: a missing or broken file is a config error naming the line
        return value

    def router_settings(self, model: str, mode: str, transport: str) -> RouterSettings:
        """The settings of a Router over a cluster of `model` in `mode` whose workers move KV over `transport`."""
        from router.chat_template import ChatOptions, load_chat_template
        from router.settings import RouterSettings

        return RouterSettings(
            model=model, mode=mode, transport=transport, routing=self.routing, max_inflight=self.max_inflight,
            skip_prefill_max_uncached_tokens=self.skip_prefill_max_uncached_tokens,
            request_timeout_s=self.request_timeout_s, prefill_timeout_s=self.prefill_timeout_s,
            slo_ttft_ms=self.slo_ttft_ms, slo_itl_ms=self.slo_itl_ms, max_predicted_ttft_ms=self.max_predicted_ttft_ms,
            stall_timeout_steps=self.stall_timeout_steps, stall_timeout_min_s=self.stall_timeout_min_s,
            client_stall_timeout_s=self.client_stall_timeout_s, stream_buffer_chunks=self.stream_buffer_chunks,
            stream_interval=self.stream_interval,
            lease_s=self.lease_s, chat=ChatOptions(
                None if self.chat_template is None else load_chat_template(self.chat_template), self.tool_call_parser))
