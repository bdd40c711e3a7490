"""ar and csv: one target forward and one head call per token, on the full head or the certified one."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.backends import BACKENDS
from runtime.loops.decode import stream_ar
from runtime.heads import FullHead
from runtime.methods.build import target_head
from runtime.methods.registry import MethodEntry, register_method
from runtime.methods.spec import HEADS, MethodSpec
from runtime.methods.streamer import Streamer
from runtime.session import Session


@dataclass(frozen=True)
class ArOptions:
    """ar[:BACKEND]: plain decoding, on the session's backend or another one of the same model (a same-run reference)."""

    backend: str | None = None

    @classmethod
    def parse(cls, args: list[str]) -> ArOptions:
        backends = [b for b in BACKENDS if b != "auto"]
        if len(args) > 1 or (args and args[0] not in backends):
            raise ValueError(f"method 'ar' takes no argument or a backend ({', '.join('ar:' + b for b in backends)}), "
                             f"not ar:{':'.join(args)}")
        return cls(*args)

    def format(self) -> tuple[str, ...]:
        return () if self.backend is None else (self.backend,)

    def build(self, session: Session, spec: MethodSpec) -> Streamer:
        if self.backend is None:
            return _plain(session.target, target_head(session, spec))
        target = session.target_on(self.backend)  # its fp32 weights are loaded if that backend needs them
        return _plain(target, FullHead(target.head_weight, target.head_bias))


@dataclass(frozen=True)
class CsvOptions:
    """csv[:BOUND]: plain decoding through the certified head with that bound (screen, screen4 or cluster)."""

    bound: str = "screen"

    @classmethod
    def parse(cls, args: list[str]) -> CsvOptions:
        options = cls(*args[:1])
        if len(args) > 1 or options.head not in HEADS:
            raise ValueError(f"method 'csv' takes one bound: csv:screen, csv:screen4 or csv:cluster, not csv:{':'.join(args)}")
        return options

    @property
    def head(self) -> str:
        return f"csv:{self.bound}"

    def format(self) -> tuple[str, ...]:
        return (self.bound,)

    def build(self, session: Session, spec: MethodSpec) -> Streamer:
        return _plain(session.target, target_head(session, spec))


def _plain(target, head) -> Streamer:
    """One target forward and one `head` call per token."""
    def stream(prompt, n, params, generator, min_new_tokens=0, stop=None):
        return stream_ar(target, head, prompt, n, params, generator, min_new_tokens, stop)

    return stream


register_method(MethodEntry("ar", ArOptions, "ar[:native|lean|transformers] (plain decoding; ar:BACKEND: on another "
                                             "backend, a same-run reference)"))
register_method(MethodEntry("csv", CsvOptions, "csv[:screen|screen4|cluster] (certified head)", head=lambda options: options.head))
