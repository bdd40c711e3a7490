"""A response's text as its tokens arrive: whole characters only, nothing from a stop string on."""

from __future__ import annotations


class TextDeltas:
    """The text each new token adds to a response, as the OpenAI API returns it.

    The decoding loops keep a stop string's tokens in their output (runtime.text.stopping); the API's text
    ends before the stop string, so with stop strings the last len(longest) - 1 characters are held
    back until they can no longer begin one. A split multi-byte character waits for its rest.
    """

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.hold = max((len(stop) for stop in stops), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""  # the text handed out so far

    def add(self, token: int) -> str:
        """The text `token` adds that is safe to send now ('' while it may still turn out to be a stop)."""
        self.tokens.append(token)
        return self._advance(final=False)

    def finish(self) -> str:
        """The rest of the response's text, once no token follows."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cuts = [text.find(stop) for stop in self.stops if stop in text]
        if cuts:
            text = text[: min(cuts)]
        elif not final:
            if text.endswith("\ufffd"):  # the rest of a split character is still to come
                return ""
            text = text[: len(text) - self.hold]
        if len(text) <= len(self.text) or not text.startswith(self.text):
            return ""  # nothing new (text sent is never taken back)
        delta, self.text = text[len(self.text) :], text
        return delta
