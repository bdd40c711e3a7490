"""Turn prompt text into token ids, optionally through the tokenizer's chat template."""

from __future__ import annotations

import torch

from runtime.models.tokenizer import NO_CHAT_TEMPLATE


def encode_prompt(tokenizer, text: str | list[dict], chat: bool = False) -> torch.Tensor:
    """Token ids [P] for a prompt; with chat=True the text is one user turn plus the generation prompt
    (or `text` is the conversation: a list of {"role", "content"} messages, as the OpenAI API sends it)."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"this tokenizer {NO_CHAT_TEMPLATE}")
        messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(text)["input_ids"]
    if not ids:
        raise ValueError("the prompt encodes to no tokens; give some text")
    return torch.tensor(ids, dtype=torch.long)


class TextStream:
    """Print decoded text as tokens arrive (re-decoding so multi-token characters come out whole)."""

    def __init__(self, tokenizer, write) -> None:
        self.tokenizer = tokenizer
        self.write = write
        self.tokens: list[int] = []
        self.printed = 0

    def __call__(self, token: int) -> None:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # wait for the rest of a split character
            self.write(text[self.printed :])
            self.printed = len(text)
