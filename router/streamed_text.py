"""The text contract of a run across workers: how much of the output text the client has."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class StreamedText:
    """The text side of a run: what the client got so far.

    NOTE: one text contract across workers: the worker that takes the request over next (the decode worker after
    the handoff, another one after a failover) is told how many characters the client has (`sent_chars`) and
    resumes its detokenizer there, so each chunk's text is exact and nothing is repaired afterwards.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.sent_chars = 0  # characters of the output text streamed so far

    def sent(self, text: str) -> None:
        self.sent_chars += len(text)

    def last(self, text: str, final_text: str) -> str:
        """The last chunk's text; the whole stream must be as long as the worker's final text (logged if not)."""
        if self.sent_chars + len(text) != len(final_text):
            log.error("%s: streamed %d characters, the final text has %d", self.request_id,
                      self.sent_chars + len(text), len(final_text))
        return text
