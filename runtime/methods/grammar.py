"""Method names in the grammar -> MethodSpec: the name, its registered options' parse, the +HEAD suffix.

Grammar (what `runtime generate --method`, `runtime bench --methods` and `runtime.api` accept):

    ar | ar:BACKEND                                  plain decoding (ar:transformers: on transformers' forward)
    llamacpp[:lookup[:K]|:bin]                       llama.cpp's plain (or prompt lookup) decoding of the same GGUF (a
                                                     reference); :bin: by llama.cpp's own llama-server binary
    csv | csv:screen | csv:screen4 | csv:cluster     the certified head (CSV-Decode and our screens)
    spec:DRAFTER[:gamma=G][:adaptive][:no-verifier][+csv[:screen|screen4|cluster]]
    dynaspec:... | frspec:...                        spec with that shortlisted drafter (same options)
    screenspec:layers:N[:gamma=G][:adaptive]         layers:N drafting with the int8 screening head
    swarm:onedecode:K | swarm:DRAFTER:K[:gamma=G][:nodes=N][+csv[:screen4|cluster]]
                                                     SWARM token trees: K candidates per slot (lookup: K
                                                     continuations), depth G, N nodes
    mjsd:DRAFTER[:beam=M][:tau=T][:gamma=G]          MJSD beam drafts (NOT distribution-preserving)

DRAFTER is any registered drafter (runtime.drafters.DRAFTERS). Without gamma=G, spec drafts up to 4
tokens per round (adapting within 1..8), only the positions whose recent drafts were accepted often
enough to pay for their verify rows (runtime.loops.speculative.DraftBudget); with gamma=G every round
drafts what the drafter finds, up to G. Trees and MJSD go 4 deep. A method is one module of
runtime.methods: its options dataclass (parse, format, build) and one `register_method` call.
"""

from __future__ import annotations

from dataclasses import replace

from runtime.common.checks import comma_items
from runtime.drafters import drafters_help
from runtime.methods.registry import ALIASES, METHODS
from runtime.methods.spec import HEADS, MethodSpec, canonical, marked

HEAD_DRAFTER = "eagle:conf=0.3:head=1:lookup"  # the default's drafter where the artifact has a head (docs/methods.md)
_LOOKUP_DEFAULTS = "spec:lookup+csv:screen4, else spec:lookup+csv, else spec:lookup"  # default_method without a head
DEFAULT_METHOD_HELP = (f"the fastest exact method the artifact and CPU allow: {_LOOKUP_DEFAULTS}; with a trained draft "
                       f"head (prep train-drafter) {HEAD_DRAFTER} drafts instead of lookup")
SERVING_DEFAULT_METHOD_HELP = (f"the fastest exact method the artifact and CPU allow with lookup: {_LOOKUP_DEFAULTS}, "
                               "also where the artifact has a draft head: the head drafts for each request apart, which "
                               "costs a loaded server more than it gains (a request may name spec:eagle:...)")


def default_method(bound: str | None, has_head: bool = False) -> MethodSpec:
    """The method run when none is named: verified through the certified head with `bound` (screen4 or
    screen), or through the full head when the artifact has no screening stage (bound None), drafting by
    prompt lookup, or where the artifact has a trained draft head (`has_head`) by the head beside lookup
    (HEAD_DRAFTER: lookup where the context has a match, else one draft of the head's where it is confident):
    lookup measured the fastest drafter without a head on every packaged model, the head beside it even with
    it on gemma3-270m and smollm2-135m and faster on qwen2.5-coder, and one head draft a round faster than
    a chain of them in 10 of 12 cells (docs/methods.md#the-default-method)."""
    drafter = HEAD_DRAFTER if has_head else "lookup"
    return parse_method(f"spec:{drafter}+csv:{bound}" if bound else f"spec:{drafter}")


def methods_help() -> str:
    """The registered methods (each followed by its aliases) and the drafters, for --help texts."""
    lines = []
    for entry in METHODS.values():
        lines.append(marked(entry.help, entry.distribution_preserving))
        lines += [alias.help for alias in ALIASES.values() if alias.method == entry.name]
    return "; ".join(lines) + ". DRAFTER: " + drafters_help() + "."


def parse_method(text: str) -> MethodSpec:
    """One method name in the grammar above -> MethodSpec; every mistake is a one-line ValueError naming the fix."""
    text = text.strip()
    base, plus, suffix = text.partition("+")
    name, *args = base.split(":")
    if name in ALIASES:
        name, args = ALIASES[name].method, [name, *args]
    if name not in METHODS:
        raise ValueError(f"unknown method {text!r}; known: {', '.join([*METHODS, *ALIASES])} (e.g. ar,csv:screen,spec:ngram)")
    entry = METHODS[name]
    options = entry.options.parse(args)
    spec = MethodSpec(name, options, head=entry.head(options), text=text)
    if plus:
        spec = replace(spec, head=_suffix_head(text, suffix))
        if not entry.suffix:
            takers = ", ".join(n for n, e in METHODS.items() if e.suffix)
            raise ValueError(f"+csv applies to drafting methods ({takers} and their aliases), not to {name}; use csv "
                             "for the certified head alone")
    if spec.certified and not spec.verifier:  # no target forward: no head to verify with
        raise ValueError(f"no-verifier decodes with the drafter alone, so a +csv head would verify nothing; drop the +csv "
                         f"suffix: {base}")
    return spec


def _suffix_head(text: str, suffix: str) -> str:
    """The head a +SUFFIX names (+csv: the screen bound), or a one-line ValueError."""
    head = {"csv": "csv:screen", **{h: h for h in HEADS if h != "full"}}.get(suffix)
    if head is None:
        raise ValueError(f"unknown suffix +{suffix} in {text!r}; use +csv (screen bound), +csv:screen4 or +csv:cluster")
    return head


def parse_methods(text: str) -> list[MethodSpec]:
    """--methods' comma-separated names (comma_items), each parsed, no method under two spellings (check_distinct)."""
    return check_distinct([parse_method(name) for name in comma_items(text, "--methods", "ar,csv:screen")])


def check_distinct(specs: list[MethodSpec]) -> list[MethodSpec]:
    """`specs`, or a ValueError naming a method listed twice (also under two spellings).

    A bench runs each method once per prompt, and two runs of one method would be reported as one.
    """
    first_text: dict[MethodSpec, str] = {}
    for spec in specs:
        key, text = replace(spec, text=""), spec.text or canonical(spec)  # the method, whatever its spelling
        if key in first_text:
            same = "is listed twice" if first_text[key] == text else f"names the same method as {first_text[key]!r}"
            raise ValueError(f"{text!r} {same}; list each method once")
        first_text[key] = text
    return specs
