"""The KV hand-off after the first token: the first token goes to the client while the prefill worker's KV is
still moving; the prefill worker's final result (or its failure) comes after.

1. `HandOff.start` waits for the call's final result in a task of its own;
2. done: the transfer's figures (ms after the first token, bytes) go into the run's timeline;
3. failed (the KV did not arrive, the prefill worker died): the decode stream that waits for that KV fails at
   once with the error (`DeltaStream.fail`), and the run continues elsewhere with the prompt and the token the
   client has (router/flow.py, decode failover): the client sees every token once, as after any failover;
4. `settled` before the last chunk (the figures are final), `cancel` when the run ends early.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from cluster.messages import PrefillResult
from router.errors import WorkerFailed, unwrap
from router.results import Timeline
from router.streams import OpenStream, PrefillCall

log = logging.getLogger(__name__)
SETTLE_S = 1.0  # the most the last chunk waits for the figures (the KV landed before any decode token came)


class HandOff:
    """The rest of one prefill call, after its first token."""

    def __init__(self, call: PrefillCall, opened: OpenStream, timeline: Timeline, timeout_s: float,
                 request_id: str) -> None:
        self.call, self.opened, self.timeline, self.request_id = call, opened, timeline, request_id
        self._task = asyncio.ensure_future(self._final(timeout_s))

    async def _final(self, timeout_s: float) -> None:
        try:
            res: PrefillResult = await self.call.final(timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the hand-off fails the decode stream over
            err = unwrap(e)
            if not self.opened.handoff:  # NOTE: the decode worker streamed already: its KV had landed
                log.info("%s: the prefill call ended with %s after the hand-off", self.request_id, err)
                return
            log.warning("%s: the KV did not reach %s (%s); continuing elsewhere", self.request_id,
                        self.opened.worker.name, err)
            self.opened.stream.fail(err if isinstance(err, Exception) else WorkerFailed(str(err), self.request_id))
            return
        finally:
            self.call.close()
        self.timeline.transfer_ms = res.transfer_ms
        self.timeline.kv_blocks_sent, self.timeline.kv_bytes_sent = res.kv_blocks_sent, res.kv_bytes_sent

    async def settled(self) -> None:
        """Wait (briefly) for the figures: the last chunk's timeline carries them."""
        with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._task), SETTLE_S)

    def cancel(self) -> None:
        self._task.cancel()
        self.call.close()
