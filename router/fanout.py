"""`n > 1`: one request's n choices as n runs through the cluster that share the prompt's KV, merged into one stream.

1. choice 0 starts alone: its prefill computes the prompt's KV once (the prefill worker's prefix cache, and through
   the handoff the decode worker's, then hold its full blocks);
2. once its first token is out, choices 1 .. n-1 start: their prompts are prefix-cache hits on both workers (only
   the last, partial block is computed again, and written per choice: the copy-on-write of a shared block), and the
   decode worker's blocks are shared by reference;
3. each choice is an ordinary run (its own failover: a decode worker that dies continues each of the n) with its
   own random stream: choice i samples with seed + i; chunks carry their choice's `index`;
4. a choice that fails fails the request: the others are closed (aborted on their workers);
5. a chat that offered tools gets its calls read out of each choice's text (router/tool_stream.py);
6. backpressure: at most `2 n` chunks wait between the choices and the front; a client that stops reading leaves
   each choice's relay (router/relay.py) full, the relay cuts the choice off at `router.client_stall_timeout_s`, and
   a choice cut off that way ends the whole response (the front's task is cancelled, as for one choice).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Callable

from router.relay import ending_with_front
from router.results import Chunk
from router.tool_stream import tool_chunks
from router.validate import Checked

Open = Callable[[Checked], AsyncGenerator[Chunk, None]]


def choice_request(checked: Checked, index: int) -> Checked:
    """Choice `index` of a request: its own id and random stream (seed + index); the prompt's logprobs only once."""
    if checked.params.n == 1:
        return checked
    params = dataclasses.replace(checked.params, n=1, seed=((checked.params.seed or 0) + index) % 2**64,
                                 prompt_logprobs=checked.params.prompt_logprobs if index == 0 else None)
    rid = checked.request_id if index == 0 else f"{checked.request_id}-{index}"
    return Checked(rid, checked.token_ids, params)


def fan_out(open_run: Open, checked: Checked) -> AsyncGenerator[Chunk, None]:
    """The chunks of every choice as they come (`Chunk.index`), tool calls parsed when the chat offered tools."""
    chunks = _choices(open_run, checked)
    return chunks if checked.tools is None else tool_chunks(chunks, checked.tools)


async def _choices(open_run: Open, checked: Checked) -> AsyncGenerator[Chunk, None]:
    """The chunks of every choice as they come; one choice is passed through untouched."""
    n = checked.params.n
    if n == 1:
        async with contextlib.aclosing(open_run(checked)) as chunks:
            async for chunk in chunks:
                yield chunk
        return
    queue: asyncio.Queue[Chunk | BaseException | None] = asyncio.Queue()
    # NOTE: chunks take a slot, ends and errors do not (they must never wait): the choices' relays see a front that
    # does not read and cut it off, instead of the router buffering whole generations for it
    slots = asyncio.Semaphore(2 * n)
    first_out = asyncio.Event()
    owner = asyncio.current_task()
    closing = [False]

    async def pump(index: int) -> None:
        try:
            async with contextlib.aclosing(open_run(choice_request(checked, index))) as chunks:
                async for chunk in chunks:
                    if closing[0]:  # NOTE: a cancel this pump missed (router/relay.py): it stops all the same
                        raise asyncio.CancelledError
                    chunk.index = index
                    await slots.acquire()
                    queue.put_nowait(chunk)
                    first_out.set()
            queue.put_nowait(None)
        except asyncio.CancelledError:
            if not closing[0] and owner is not None:  # NOTE: the choice's relay cut a client that stopped reading
                owner.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - handed to the reader, which fails the whole request
            queue.put_nowait(e)

    tasks = [asyncio.create_task(pump(0))]
    with ending_with_front(tasks):  # NOTE: the choices go with the front's task (router/relay.py)
        try:
            done = 0
            while done < n:
                if len(tasks) == 1 and first_out.is_set():
                    tasks += [asyncio.create_task(pump(i)) for i in range(1, n)]
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    done += 1
                    if len(tasks) == 1:  # NOTE: choice 0 ended without a token: start the others all the same
                        tasks += [asyncio.create_task(pump(i)) for i in range(1, n)]
                    continue
                slots.release()
                yield item
        finally:
            closing[0] = True
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
