"""The words drafter options share: integer, [0, 1] and number arguments, and NAME[:MAX_NGRAM] (ngram, lookup)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

from runtime.common.checks import is_digits
from runtime.drafters.base import Drafter
from runtime.drafters.registry import DraftContext


def positive(value: str, what: str, example: str) -> int:
    """A positive integer argument, or a one-line error naming the fix."""
    if not is_digits(value) or int(value) < 1:
        raise ValueError(f"{what} takes an integer >= 1, not {value!r}; e.g. {example}")
    return int(value)


def unit_number(text: str) -> float | None:
    """An argument's number in [0, 1] (a probability, a confidence, a score), or None where it is not one."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0.0 <= value <= 1.0 else None


def no_arguments(name: str, args: list[str]) -> None:
    """A one-line error unless a drafter that takes no argument got none."""
    if args:
        raise ValueError(f"{name} takes no argument, not {name}:{':'.join(args)}")


def number_text(value: float) -> str:
    """The shortest text of `value` that reads back as it: '0.25', '0', '0.1' (a canonical option value)."""
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


def need_artifact(context: DraftContext, name: str):
    """The context's artifact, or a one-line error: the drafter reads stages of it."""
    if context.artifact is None:
        raise ValueError(f"the {name} drafter needs the artifact whose stages it reads")
    return context.artifact


@dataclass(frozen=True)
class MaxNgramOptions:
    """NAME[:MAX_NGRAM]: the longest n-gram looked up (None: the drafter's default); a subclass names the drafter."""

    NAME: ClassVar[str]
    EXAMPLE: ClassVar[int]  # a good MAX_NGRAM, shown in errors
    DRAFTER: ClassVar[Callable[..., Drafter]]

    max_ngram: int | None = None

    @classmethod
    def parse(cls, args: list[str]) -> MaxNgramOptions:
        if len(args) > 1:
            raise ValueError(f"{cls.NAME} takes at most one argument (the longest n-gram), not {':'.join(args)!r}; "
                             f"e.g. {cls.NAME}:{cls.EXAMPLE}")
        return cls(positive(args[0], f"{cls.NAME}:MAX_NGRAM", f"{cls.NAME}:{cls.EXAMPLE}") if args else None)

    def format(self) -> tuple[str, ...]:
        return () if self.max_ngram is None else (str(self.max_ngram),)

    def build(self, context: DraftContext) -> Drafter:
        return self.DRAFTER() if self.max_ngram is None else self.DRAFTER(self.max_ngram)
