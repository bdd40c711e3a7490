"""Stop strings: end generation once the decoded response contains any of some strings.

The check runs after every appended token, so a hit always ends at the token just appended: the
loops stop there and return the tokens up to and including the one that completes the stop string
(the stop string's tokens stay in the output, as with transformers' `stop_strings`). It is a
function of the response tokens alone, so plain and speculative decoding stop at the same token
wherever it falls inside an accepted run of drafts.
"""

from __future__ import annotations

# Characters of context kept before the newest token beyond the longest stop string: a window that
# starts mid-character or drops the first token's leading space differs from the full text only in
# its first few characters.
SLACK_CHARS = 8


class StopStrings:
    """Stop strings over a tokenizer; `hit(tokens)` tells whether the response tokens now contain one."""

    def __init__(self, tokenizer, stops) -> None:
        self.stops = tuple(stops)
        if not self.stops or any(not stop for stop in self.stops):
            raise ValueError("stop strings must be non-empty text; drop the empty --stop values (stop=)")
        self.tokenizer = tokenizer
        self.longest = max(len(stop) for stop in self.stops)

    def hit(self, tokens: list[int]) -> bool:
        """Whether the decoded response `tokens` contain a stop string (called after each new token).

        Only a tail window is decoded: enough tokens before the newest one to hold the longest stop
        string plus SLACK_CHARS, doubling the window while special or byte tokens decode to less.
        An earlier occurrence would have stopped generation already, so any match is new.
        """
        if not tokens:
            return False
        before = self.longest + SLACK_CHARS  # tokens before the newest: most decode to >= 1 character
        while True:
            start = max(0, len(tokens) - 1 - before)
            if start == 0 or len(self._decode(tokens[start:-1])) >= self.longest + SLACK_CHARS:
                break
            before *= 2
        text = self._decode(tokens[start:])
        return any(stop in text for stop in self.stops)

    def _decode(self, tokens: list[int]) -> str:
        # The response as the user sees it (runtime.text.prompting.TextStream skips special tokens too).
        return self.tokenizer.decode(tokens, skip_special_tokens=True)
