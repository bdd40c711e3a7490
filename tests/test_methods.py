"""The method grammar and its registry: every registered name parses, round-trips, fails cleanly, and
`runtime generate --method NAME` decodes what `runtime bench --methods NAME` decodes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from factories import tiny_artifact
from runtime.drafters import DRAFTERS, parse_drafter
from runtime.methods import ALIASES, METHODS, canonical, default_method, methods_help, parse_method, parse_methods

# One example per registration (methods, aliases and drafters); a new registration without one fails below.
EXAMPLES = {
    "ar": ["ar", "ar:transformers"], "csv": ["csv", "csv:screen", "csv:cluster"],
    "spec": ["spec:ngram", "spec:ngram:2:gamma=2", "spec:layers:1:adaptive+csv", "spec:ngram+csv:cluster"],
    "dynaspec": ["dynaspec:layers:1:k=2"], "frspec": ["frspec:int8:20:context=0+csv"],
    "screenspec": ["screenspec:layers:1:gamma=3"],
    "swarm": ["swarm:onedecode:4", "swarm:int8:4", "swarm:layers:1:2:gamma=3:nodes=8+csv"],
    "mjsd": ["mjsd:int8", "mjsd:layers:1:beam=2:tau=0.5:gamma=3"], "llamacpp": ["llamacpp", "llamacpp:lookup:4"],
}
DRAFTER_EXAMPLES = {"ngram": "ngram:3", "lookup": "lookup:4", "suffix": "suffix:match=8:prob=0.2", "layers": "layers:1", "gp": "gp:16:act", "model": "model:some/dir",
                    "int8": "int8", "dynaspec": "dynaspec:int8:k=4", "frspec": "frspec:layers:1:20",
                    "onedecode": "onedecode:fallback=ngram", "eagle": "eagle:frspec=512:lookup"}
# The tiny model's artifact has the screen and clusters stages only: no router, no gp bases, one layer to drop.
RUNNABLE = ["ar", "ar:transformers", "csv", "csv:cluster", "spec:ngram:gamma=2", "spec:layers:1:adaptive+csv",
            "spec:ngram+csv:cluster", "screenspec:layers:1:gamma=3", "spec:suffix:gamma=2"]


def meaning(spec):
    """A spec without the text it was spelled as."""
    return replace(spec, text="")


def test_every_registration_has_an_example_that_round_trips():
    """parse(canonical(parse(text))) == parse(text) for an example of every method, alias and drafter."""
    assert set(EXAMPLES) == set(METHODS) | set(ALIASES) and set(DRAFTER_EXAMPLES) == set(DRAFTERS)
    for name in [n for names in EXAMPLES.values() for n in names] + [f"spec:{d}" for d in DRAFTER_EXAMPLES.values()]:
        spec = parse_method(name)
        assert meaning(parse_method(canonical(spec))) == meaning(spec) and str(spec) == name
        assert canonical(parse_method(canonical(spec))) == canonical(spec)
        assert isinstance(spec.options, METHODS[spec.name].options)  # a typed value, not words
        assert spec.distribution_preserving == METHODS[spec.name].distribution_preserving
    for text in DRAFTER_EXAMPLES.values():
        drafter = parse_drafter(text)
        assert parse_drafter(str(drafter)) == drafter and isinstance(drafter.options, DRAFTERS[drafter.name].options)
    assert not parse_method("spec:int8:no-verifier").distribution_preserving and not parse_method("llamacpp").distribution_preserving
    help_text = methods_help()
    assert all(name in help_text for name in list(METHODS) + list(ALIASES) + list(DRAFTERS))


def test_two_spellings_of_one_value_parse_equal():
    """Options are values: defaults written out or left off, and options in another order, name one method."""
    same = [("spec:ngram+csv", "spec:ngram+csv:screen"), ("dynaspec:int8", "spec:dynaspec:int8:k=16:context=1"),
            ("mjsd:int8:tau=0.1:beam=4", "mjsd:int8"), ("swarm:lookup:4", "swarm:lookup:4:nodes=16"),
            ("spec:eagle:lookup:frspec=8", "spec:eagle:frspec=8:lookup"), ("spec:gp:16:weights", "spec:gp:16"),
            ("spec:onedecode:threshold=0.250", "spec:onedecode"), ("llamacpp:lookup", "llamacpp:lookup:10")]
    for one, other in same:
        assert meaning(parse_method(one)) == meaning(parse_method(other)), (one, other)
    assert meaning(parse_method("spec:ngram")) != meaning(parse_method("spec:ngram:3"))  # the default left to the drafter


# Names as the docs, README and bench records spell them, and their canonical text before the options were typed:
# bench records and docs hold these, so the canonical text of each must not change.
CANONICAL = json.loads((Path(__file__).parent / "data" / "canonical-methods.json").read_text())


@pytest.mark.parametrize("name", sorted(CANONICAL))
def test_the_canonical_text_of_documented_names_is_unchanged(name):
    spec = parse_method(name)
    assert canonical(spec) == CANONICAL[name] and meaning(parse_method(CANONICAL[name])) == meaning(spec)


def test_the_default_method_drafts_by_lookup_or_the_head_through_the_best_bound_given():
    """What generate runs without --method: exact (distribution-preserving) in every case."""
    named = {bound: canonical(default_method(bound)) for bound in ("screen4", "screen", None)}
    assert named == {"screen4": "spec:lookup+csv:screen4", "screen": "spec:lookup+csv:screen", None: "spec:lookup"}
    headed = {bound: canonical(default_method(bound, has_head=True)) for bound in ("screen4", "screen", None)}
    assert headed == {"screen4": "spec:eagle:conf=0.3:head=1:lookup+csv:screen4",
                      "screen": "spec:eagle:conf=0.3:head=1:lookup+csv:screen", None: "spec:eagle:conf=0.3:head=1:lookup"}
    assert all(default_method(bound, head).distribution_preserving for bound in named for head in (False, True))


@pytest.mark.parametrize("name, fragment", [
    ("spec:ngram:gamma=abc", "gamma takes an integer in 1..8"), ("spec:ngram:gamma=9", "1..8"),
    ("warp", "unknown method"), ("csv:fast", "csv:screen, csv:screen4 or csv:cluster"), ("spec", "spec needs a drafter"),
    ("spec:draft-model", "unknown drafter"), ("spec:ngram:no-verifier", "gp, int8"), ("ar+csv", "+csv applies"),
    ("spec:ngram+fast", "use +csv"), ("spec:layers:x", "layers:N"), ("dynaspec:int8:k=0", "k=8"),
    ("dynaspec:int8:schedule=z", "fixed or position"), ("frspec:int8", "TOKENS"), ("spec:gp:16:foo", "gp:RANK"),
    ("screenspec:layers:2+csv", "+csv"), ("ar:fast", "ar:transformers"), ("spec:lookup:x", "lookup:4"),
    # digits outside ASCII: int() reads '٣' as 3 and refuses '²' with its own message
    ("spec:ngram:gamma=\u0663", "gamma takes an integer in 1..8"), ("spec:ngram:gamma=\u00b2", "gamma takes an integer in 1..8"),
    ("spec:lookup:\u00b2", "lookup:4"), ("spec:layers:\u0663", "layers:N"), ("swarm:int8:\u00b2", "swarm"),
])
def test_bad_names_are_one_line_errors_naming_the_fix(name, fragment):
    with pytest.raises(ValueError) as error:
        parse_method(name)
    assert fragment in str(error.value) and "\n" not in str(error.value) and "invalid literal" not in str(error.value)


def test_a_method_list_reads_each_name_stripped():
    assert [spec.text for spec in parse_methods(" ar , csv:screen,spec:ngram ")] == ["ar", "csv:screen", "spec:ngram"]


@pytest.mark.parametrize("text, message", [
    ("ar,,csv", "'ar,,csv' has an empty item (a stray comma?); write --methods ar,csv"),
    ("ar,csv,ar", "'ar,csv,ar' lists 'ar' twice; list each once: --methods ar,csv"),
    ("ar,csv,csv:screen", "'csv:screen' names the same method as 'csv'; list each method once"),
    ("ar,warp", "unknown method 'warp'"),
], ids=["empty-item", "repeat", "two-spellings", "unknown"])
def test_a_bad_method_list_is_one_line_naming_the_fix(text: str, message: str):
    with pytest.raises(ValueError) as error:
        parse_methods(text)
    assert str(error.value).startswith(message)


@pytest.fixture(scope="module")
def artifact(tiny_model_dir, tmp_path_factory) -> Path:
    return tiny_artifact(tiny_model_dir, tmp_path_factory.mktemp("methods"))


def test_generate_decodes_what_bench_decodes_for_every_runnable_method(artifact, tmp_path, monkeypatch):
    from runtime.cli import main as runtime_main

    monkeypatch.setenv("SPECVOCAB_CACHE", str(artifact.parent / "cache"))
    prompt = "w5 w9 w31 w5 w9"
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"text": prompt}]))
    out = tmp_path / "bench.json"
    bench = CliRunner().invoke(runtime_main, ["bench", str(artifact), "--prompts", str(prompts), "--methods",
                                              ",".join(RUNNABLE), "-n", "1", "--max-new-tokens", "10", "--json", str(out)])
    assert bench.exit_code == 0, bench.output
    record = json.loads(out.read_text())
    assert record["setup"]["peak_rss_mib"] > 0 and "peak_rss_mib" in out.with_suffix(".md").read_text()
    assert all(row["identical_to_greedy"] == 1.0 for row in record["methods"])
    texts = {}
    for name in RUNNABLE:
        result = CliRunner().invoke(runtime_main, ["generate", str(artifact), "--method", name, "--prompt", prompt,
                                                   "--max-new-tokens", "10", "--threads", "1"])
        assert result.exit_code == 0, result.output
        texts[name] = result.stdout
    assert len(set(texts.values())) == 1 and texts["ar"].strip()


def test_generate_help_lists_the_registry():
    from runtime.cli import main as runtime_main

    for command in ("generate", "bench"):
        text = " ".join(CliRunner().invoke(runtime_main, [command, "--help"]).output.split())
        assert all(f"{name}" in text for name in ("screenspec", "dynaspec", "int8", "ngram[:MAX_NGRAM]"))


def test_bad_method_fails_before_the_model_loads(tmp_path):
    from runtime.cli import main as runtime_main

    result = CliRunner().invoke(runtime_main, ["generate", str(tmp_path / "nowhere"), "--method", "spec:ngram:gamma=x",
                                               "--prompt", "hi"])
    assert result.exit_code != 0 and "gamma takes an integer" in result.output and "Traceback" not in result.output
