"""Text stop sequences (``SamplingParams.stop``), matched on the detokenized output as the host reads it back.

:class:`StopStrings` follows one request's output: after each new token it decodes the output so far and looks
for a stop string ending in the text that token added (the earliest such match over all stop strings). On a
match the request finishes: its token ids end with the token that completed the match (tokens the same step
emitted after it are dropped) and its text is cut before the match, as vLLM does. Until ``min_tokens`` tokens
were generated no match counts, and a match that ended then is not found later (only text that new tokens add
is searched).

The host loop checks on every commit (a stop string ends the request from the next step on; a step already in
flight for it is discarded); the device loop, which decodes a wave without the host, checks each output once at
the end of its wave (the tokens after the match were computed for nothing).
"""

from __future__ import annotations

__all__ = ["StopStrings"]


class StopStrings:
    """One request's stop strings: ``feed`` its output after each read-back."""

    def __init__(self, stop: tuple[str, ...], tokenizer, *, min_tokens: int = 0):
        self.stop = tuple(stop)
        self.tokenizer = tokenizer
        self.min_tokens = int(min_tokens)
        self.checked = 0  # output tokens already searched
        self.text_len = 0  # characters of their text
        self.text: str | None = None  # the cut text, once a stop string matched
        self.matched: str | None = None

    def feed(self, output: list[int]) -> int | None:
        """The number of tokens to keep when a stop string completed in ``output[self.checked:]``, else None."""
        while self.checked < len(output):
            n = self.checked + 1
            text = self.tokenizer.decode(output[:n])
            self.checked = n
            start_new = min(self.text_len, len(text))
            self.text_len = len(text)
            if n < self.min_tokens:
                continue
            best = None
            for s in self.stop:
                i = text.find(s, max(0, start_new - len(s) + 1))
                if i >= 0 and (best is None or i < best[0]):
                    best = (i, s)
            if best is not None:
                self.text, self.matched = text[:best[0]], best[1]
                return n
        return None
