"""`prep traces`: a teacher-forced run of the target over a corpus, written as safetensors shards.

Each text (a ShareGPT conversation through the chat template, a HumanEval prompt, or a text of a
JSON file) is cut to `max_tokens_per_text` tokens and run through the target in one forward, on the
backend `auto` picks: the native one wherever it reads the model's GGUF, so the states are bit for bit
those the runtime computes (and the forward ~1.7x torch's), lean or transformers otherwise.
Per position the shards hold the input id, the final-normed hidden state (float16), the next
token (-1 at a text's last position), the target's top-1, its top TOP_TOKENS tokens with their
probabilities (the multi-label router loss), per `drafter_layers` value N, the final-normed
hidden state after the first N layers (what a `layers:N` drafter computes) and, with
`feature_layers` (prep traces --features), the target's own features an EAGLE-3 draft head reads:
the residual stream entering each of those layers, side by side ([T, 3d] bfloat16: gemma3's residual
stream leaves float16's range).

Corpora: ShareGPT conversations, HumanEval prompts (the bench's: never train a drafter on them),
`pystdlib` (the source files of this Python's standard library: code that is not HumanEval), or a
JSON file of texts.

Texts are assigned to shards and to a split (train / validation / heldout) before any forward
runs. A packaged corpus's text is split by a hash of the corpus and its index
(`runtime.text.data.split_of`, which also keeps ShareGPT bench prompts out of training); a file's text by
a hash of its content (`split_of_text`), so moving or reordering the file keeps every split. A
rerun therefore finds the same shards: a shard whose file is intact and whose index entry is
unchanged is skipped. A rerun may add traces (a larger budget) but, without --force, neither
change their settings nor remove or shorten them; --force allows that, rebuilding every shard
whose entry changed (intact shards of the same settings are kept). Shards and the
index are written atomically (temporary sibling, fsync, rename); prep/trace_files.py reads them, and
refuses a folder whose index does not say `finished` (written last, once every shard is).
"""

from __future__ import annotations

import sys
import sysconfig
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from artifacts.atomic import atomic_write
from artifacts.writing import save_tensors
from prep.core_pool import map_on_cores, worker_count
from prep.trace_files import (CHECKSUM_FIELDS, INDEX_FILE, TRACES_FORMAT, read_index, remove_unlisted_shards, shard_checksum,
                              shard_intact, shard_name, write_index, writing_traces)
from runtime.text.data import (PACKAGED_SOURCES, SPLIT_PERCENT, SPLITS, humaneval_prompts, prompts_from_file,
                          sharegpt_conversations, split_of, split_of_text)
from runtime.backends.target import DecoderTarget
from runtime.kernels import linear, set_decoding_threads
from runtime.common.checks import comma_items, is_digits

TOP_TOKENS = 8
CODE_CORPUS = "pystdlib"  # the Python standard library's own source: code context outside HumanEval
CODE_FILE_CHARS = 6_000  # a source file's first characters make one text (about the 512-token cut)
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}
# Tokens to trace before workers pay. Measured on the Zen 5 with the native teacher (`prep traces MODEL --corpus
# sharegpt --max-tokens N --features --workers 1|2`, whole command): at 8,192 tokens two workers took 36 s against
# 51 s in one process on qwen2.5-coder, 27.8 against 31.4 on gemma3-270m, 15.7 against 16.1 on smollm2-135m; at
# 4,096 only qwen2.5-coder's gained (23 against 28 s; gemma3-270m 18.3 against 16.3). With transformers' teacher,
# whose fp32 model a worker took ~25 s to load, the threshold was 16,384.
POOL_MIN_TOKENS = 8_192
TEACHER_BACKEND = "auto"  # runtime.backends.choose_backend: native where it reads the model


def parse_layers(value) -> tuple[int, ...]:
    """Drafter depths from a recipe or flag value: 16, "15,16", or 0 / "" for none."""
    text = str(value).strip()
    if text in ("", "0"):
        return ()
    parts = comma_items(text, "--drafter-layers", "15,16")
    if not all(is_digits(n) and int(n) >= 1 for n in parts):
        raise ValueError(f"--drafter-layers (or the recipe's drafter_layers) must be depths >= 1 such as 16 or 15,16 "
                         f"(or 0 alone for none), got {value!r}")
    return tuple(int(n) for n in parts)


def parse_feature_layers(value: str | None, num_layers: int) -> tuple[int, int, int]:
    """--feature-layers: the three target layers, lowest first, whose inputs an EAGLE-3 head reads (0..N-1 of N;
    one may repeat, as EAGLE-3's default (2, N/2, N-3) does on 6 layers; None: that default), or a one-line
    ValueError naming the fix (the default as the example)."""
    from runtime.drafters.eagle_head import feature_layers

    if value is None:
        return feature_layers(num_layers)
    example = ",".join(map(str, feature_layers(num_layers)))
    parts = [part.strip() for part in str(value).split(",")]
    layers = [int(n) for n in parts if is_digits(n)]
    if len(parts) != 3 or len(layers) != 3 or layers != sorted(layers) or layers[-1] >= num_layers:
        raise ValueError(f"--feature-layers takes three layers in 0..{num_layers - 1}, lowest first, of this "
                         f"{num_layers}-layer model (the head reads their inputs), e.g. {example}; not {value!r}")
    return layers[0], layers[1], layers[2]


def corpus_texts(corpus: str, tokenizer) -> Iterator[str]:
    """Texts of "sharegpt" (whole conversations, chat template when the tokenizer has one),
    "humaneval" (the 164 prompts) or a JSON file of {"text": ...} objects."""
    if corpus == "humaneval":
        yield from humaneval_prompts()
    elif corpus == CODE_CORPUS:
        yield from stdlib_texts()
    elif corpus == "sharegpt":
        for conversation in sharegpt_conversations():
            turns = [
                {"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]}
                for t in conversation.get("conversations") or []
                if isinstance(t, dict) and t.get("from") in SHAREGPT_ROLES and isinstance(t.get("value"), str)
            ]
            # An empty text for a conversation without turns keeps text i = conversation i, the
            # index runtime.text.data.split_of assigns bench prompts by.
            yield render_chat(tokenizer, turns) if turns else ""
    else:
        yield from corpus_file_texts(corpus)


def stdlib_sources() -> Iterator[str]:
    """The standard library's .py files, whole (sorted by path; tests, idlelib and site-packages left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).parts
        if "site-packages" in relative or any(part in ("test", "tests", "idlelib") for part in relative):
            continue
        yield path.read_text(encoding="utf-8", errors="replace")


def stdlib_texts() -> Iterator[str]:
    """The standard library's .py files (stdlib_sources), each cut to CODE_FILE_CHARS characters."""
    for source in stdlib_sources():
        text = source[:CODE_FILE_CHARS].strip()
        if text:
            yield text


def corpus_file_texts(corpus: str) -> list[str]:
    """The texts of a corpus file; ValueError naming the fix for an unknown name, a bad file or an empty one."""
    if not Path(corpus).is_file():
        raise ValueError(f"unknown corpus {corpus!r}: use sharegpt, humaneval, {CODE_CORPUS}, or the path of a JSON file of {{\"text\": ...}}")
    texts = prompts_from_file(corpus)
    if not texts:
        raise ValueError(f"{corpus} holds no text; give a JSON list of {{\"text\": ...}} objects")
    return texts


def teacher_target(loaded):
    """A loaded model (runtime.models.load_model) as the teacher-forced target traces run: the backend `auto`
    picks, so the native backend (the GGUF's own blocks, the features and hidden states the runtime computes)
    wherever it reads the model; lean or transformers otherwise."""
    from runtime.backends import loaded_eos_ids, reload_target

    return reload_target(loaded, TEACHER_BACKEND, loaded_eos_ids(loaded))


def named_corpus(corpus: str) -> bool:
    """Whether `corpus` names a packaged corpus (sharegpt, humaneval, pystdlib) rather than a file of texts."""
    return corpus in PACKAGED_SOURCES or corpus == CODE_CORPUS


def check_corpus(corpus: str) -> None:
    """Refuse, before the model loads, a corpus that is not packaged and not a file of texts."""
    if not named_corpus(corpus):
        corpus_file_texts(corpus)


def render_chat(tokenizer, turns: list[dict]) -> str:
    """A conversation as the model sees it: its chat template, or plain role-prefixed turns."""
    if getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(turns, tokenize=False)
        except Exception:  # templates that reject a turn order (e.g. two user turns in a row)
            pass
    return "\n\n".join(f"{t['role']}: {t['content']}" for t in turns)


@dataclass
class ShardPlan:
    """Which texts go into one shard, decided from tokenization alone."""

    name: str
    docs: list[int]  # text indices in the corpus
    splits: list[str]
    ids: list[list[int]]

    @property
    def tokens(self) -> int:
        return sum(len(i) for i in self.ids)

    def entry(self) -> dict:
        return {"file": self.name, "docs": self.docs, "splits": self.splits, "tokens": self.tokens, "complete": True}


def plan_shards(
    texts: Iterator[str], tokenizer, corpus: str, max_tokens: int, shard_tokens: int, max_tokens_per_text: int
) -> list[ShardPlan]:
    """Tokenize texts until `max_tokens` and group them into shards of about `shard_tokens` tokens."""
    plans: list[ShardPlan] = []
    current = ShardPlan(shard_name(0), [], [], [])
    total = 0
    for index, text in enumerate(texts):
        if total >= max_tokens:
            break
        ids = tokenizer(text, add_special_tokens=not text.startswith(tokenizer.bos_token or "\0"))["input_ids"]
        ids = ids[: min(max_tokens_per_text, max_tokens - total)]
        if len(ids) < 2:
            continue
        current.docs.append(index)
        current.splits.append(split_of(corpus, index) if corpus in PACKAGED_SOURCES else split_of_text(text))
        current.ids.append(ids)
        total += len(ids)
        if current.tokens >= shard_tokens:
            plans.append(current)
            current = ShardPlan(shard_name(len(plans)), [], [], [])
    if current.docs:
        plans.append(current)
    return plans


def teacher_forward(target, tokens: torch.Tensor, layers: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor], object]:
    """One forward over tokens [T]: final-normed hidden states [T, d], the residual stream entering each of
    `layers` ({n: [T, d]}), and the final norm; on the decoder ladder through its cache's taps."""
    if isinstance(target, DecoderTarget):
        cache = target.new_cache()
        cache.tap(tuple(layers))
        hidden = target.forward(tokens, cache)
        d = target.hidden_size
        residuals = {n: cache.features[: tokens.numel(), i * d : (i + 1) * d] for i, n in enumerate(layers)}
        return hidden, residuals, target.decoder.norm
    out = target.body(input_ids=tokens.view(1, -1), use_cache=False, output_hidden_states=bool(layers))
    # hidden_states[n] is the input of layer n (the output of the first n layers), before the norm.
    return out.last_hidden_state[0], {n: out.hidden_states[n][0] for n in layers}, target.body.norm


@torch.inference_mode()
def trace_text(target, ids: list[int], drafter_layers: list[int], feature_layers: list[int] = ()) -> dict[str, torch.Tensor]:
    """One text's per-position tensors (see the module docstring)."""
    tokens = torch.tensor(ids, dtype=torch.long)
    hidden, residuals, norm = teacher_forward(target, tokens, sorted(set(drafter_layers) | set(feature_layers)))
    # Top tokens in row chunks: a 512-token text times a 262k vocabulary is 0.5 GB of logits at once.
    tops = [head_logits(target, rows).softmax(dim=1).topk(TOP_TOKENS, dim=1) for rows in hidden.split(64)]
    top_ids = torch.cat([t.indices for t in tops])  # [T, TOP_TOKENS], best first
    tensors = {
        "input_ids": tokens.to(torch.int32),
        "position": torch.arange(len(ids), dtype=torch.int32),
        "next_token": torch.cat([tokens[1:], torch.tensor([-1])]).to(torch.int32),
        "top1": top_ids[:, 0].to(torch.int32),
        "top_ids": top_ids.to(torch.int32),
        "top_probs": torch.cat([t.values for t in tops]).to(torch.float16),  # [T, TOP_TOKENS]
        "hidden": hidden.to(torch.float16),
    }
    for n in drafter_layers:
        tensors[f"hidden_layers_{n}"] = norm(residuals[n]).to(torch.float16)
    if feature_layers:
        features = torch.cat([residuals[n] for n in feature_layers], dim=1)  # [T, 3d]
        tensors["features"] = features.to(torch.bfloat16)
    return tensors


def head_logits(target, rows: torch.Tensor) -> torch.Tensor:
    """The LM head's logits [R, V] for final-normed rows [R, d]: the native kernels on the decoder ladder, torch's otherwise."""
    if isinstance(target, DecoderTarget):
        return linear(rows, target.head_weight, target.head_bias)
    return torch.nn.functional.linear(rows, target.head_weight, target.head_bias)


def load_teacher(model: str):
    """A worker's teacher target: `model` (a load_model argument) on the backend teacher_target picks, on one thread."""
    from runtime.backends import load_target

    set_decoding_threads(1, False)
    return load_target(model, TEACHER_BACKEND, progress=False)[1]


def trace_item(target, item: tuple[list[int], list[int], list[int]]) -> dict[str, torch.Tensor]:
    """trace_text of one (ids, drafter_layers, feature_layers): what a worker maps."""
    return trace_text(target, *item)


def run_shard(plan: ShardPlan, traced: Iterator[dict[str, torch.Tensor]], bar: tqdm) -> dict[str, torch.Tensor]:
    """A shard's tensors from its texts' traces, the next len(plan.ids) of `traced`: rows of all texts
    concatenated, `doc` says whose row it is."""
    parts = []
    for ids in plan.ids:
        parts.append(next(traced))
        bar.update(len(ids))
    tensors = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
    tensors["doc"] = torch.cat([torch.full((len(ids),), doc, dtype=torch.int32) for doc, ids in zip(plan.docs, plan.ids)])
    tensors["split"] = torch.cat(
        [torch.full((len(ids),), SPLITS.index(s), dtype=torch.int8) for s, ids in zip(plan.splits, plan.ids)]
    )
    return tensors


def _previous_index(out: Path, force: bool) -> dict | None:
    """The folder's traces index, or None where there is none (or, with `force`, where it is damaged)."""
    if not (out / INDEX_FILE).is_file():
        return None
    try:
        return read_index(out)
    except ValueError:
        if force:
            return None  # --force rebuilds a damaged folder
        raise


def build_traces(
    target,
    tokenizer,
    model_name: str,
    corpus: str,
    out: str | Path,
    max_tokens: int = 200_000,
    shard_tokens: int = 16_384,
    max_tokens_per_text: int = 512,
    drafter_layers: tuple[int, ...] = (),
    force: bool = False,
    option: str = "-o",
    progress: bool = True,
    feature_layers: tuple[int, ...] = (),
    workers: int | None = 1,
    model: str | None = None,
) -> dict:
    """Write (or complete) a traces folder; returns its index.

    `force` allows a rerun that changes settings or removes or shortens traces: every shard whose
    entry changed is rebuilt, intact ones of the same settings are kept, and the shard files the new
    index does not list are deleted. `option` is the flag that named the folder, for error lines.
    `workers` > 1 traces the texts on that many single-threaded processes, one per core
    (prep.core_pool), each loading `model` (a load_model argument) as `target` was loaded; None:
    prep.core_pool.worker_count's choice for the job.
    """
    layers = getattr(target.config, "num_hidden_layers", 0)
    for n in drafter_layers:
        if not 1 <= n < layers:
            raise ValueError(f"--drafter-layers takes depths in 1..{layers - 1} (the target has {layers} layers), got {n}")
    settings = {
        "format": TRACES_FORMAT,
        "model": model_name,
        "corpus": corpus,
        "max_tokens": max_tokens,
        "shard_tokens": shard_tokens,
        "max_tokens_per_text": max_tokens_per_text,
        "drafter_layers": sorted(set(drafter_layers)),
        "vocab_size": target.vocab_size,
        "hidden_size": target.hidden_size,
        "split_percent": dict(zip(SPLITS, SPLIT_PERCENT)),
        # Only where asked for, so folders written before features existed keep their settings.
        **({"feature_layers": list(feature_layers)} if feature_layers else {}),
    }
    with writing_traces(out, option) as out:
        previous = _previous_index(out, force)
        plans = plan_shards(corpus_texts(corpus, tokenizer), tokenizer, corpus, max_tokens, shard_tokens, max_tokens_per_text)
        if not plans:
            raise ValueError(f"the corpus {corpus} holds no text of 2 tokens or more; give one that does")
        if previous is not None and not force:
            check_rerun(previous, settings, plans, out, option)
        # Intact shards of the same settings (the budget aside) are kept, with --force too: it only allows removing
        # or rebuilding the rest; a shard is kept where its planned texts did not change (its index entry).
        same = previous is not None and not changed_settings(previous, settings)
        done = {e["file"]: e for e in previous["shards"] if e.get("complete")} if same else {}
        index = {**settings, "finished": False, "shards": []}  # readers refuse the folder until the end

        # The intact shards already written to their plans (checked once: a shard's sha256 reads the file).
        kept = {p.name: e for p in plans if (e := done.get(p.name)) is not None and _planned(e) == p.entry()
                and shard_intact(out / p.name, e)}
        items = [(ids, settings["drafter_layers"], list(feature_layers))
                 for plan in plans if plan.name not in kept for ids in plan.ids]
        traced = map_on_cores(worker_count(workers, sum(len(ids) for ids, _, _ in items), POOL_MIN_TOKENS),
                              trace_item, items, target, load_teacher, (model,))
        with closing(traced), tqdm(total=sum(p.tokens for p in plans), desc="traces", unit="tok",
                                   disable=not progress, file=sys.stderr) as bar:
            for position, plan in enumerate(plans):
                entry = kept.get(plan.name)
                if entry is not None:
                    bar.update(plan.tokens)
                else:
                    if (out / INDEX_FILE).exists():  # no index may list a shard while it is rewritten; later kept ones stay
                        later = [kept[p.name] for p in plans[position + 1:] if p.name in kept]
                        write_index(out, {**index, "shards": index["shards"] + later})
                    tensors = run_shard(plan, traced, bar)
                    atomic_write(out / plan.name, lambda tmp: save_tensors(tensors, tmp))
                    entry = {**plan.entry(), **shard_checksum(out / plan.name)}
                index["shards"].append(entry)
                write_index(out, index)  # after every shard, so an interrupted run resumes here
            next(traced, None)  # past the last text: the workers exit on their own, not killed (prep.core_pool)
        index["finished"] = True
        write_index(out, index)
        remove_unlisted_shards(out, index)
    return index


def check_rerun(previous: dict, settings: dict, plans: list[ShardPlan], out: Path, option: str) -> None:
    """Refuse a rerun (without --force) that would change the traces' settings, or remove or shorten traces."""
    changed = changed_settings(previous, settings)
    if changed:
        raise ValueError(f"{out} holds traces made with other settings ({', '.join(changed)}); "
                         f"pass --force to replace them, or choose another {option}")
    planned = {p.name: p.entry() for p in plans}
    lost = [e for e in previous["shards"] if not _kept_or_grown(e, planned.get(e["file"]))]
    if lost:
        held = sum(e["tokens"] for e in previous["shards"] if isinstance(e.get("tokens"), int))
        raise ValueError(f"{out} holds {held} tokens of traces and this run (a budget of {settings['max_tokens']} tokens) "
                         f"would remove or shorten {len(lost)} of its {len(previous['shards'])} shards; "
                         f"pass --force to rebuild the folder, or choose another {option}")


def changed_settings(previous: dict, settings: dict) -> list[str]:
    """The settings a rerun changes, the token budget aside (a shard whose texts stay the same is kept under any)."""
    return [k for k, v in settings.items() if k != "max_tokens" and previous.get(k) != v]


def _planned(entry: dict) -> dict:
    """A shard's index entry without its file's checksum: what its plan decides."""
    return {k: v for k, v in entry.items() if k not in CHECKSUM_FIELDS}


def _kept_or_grown(old: dict, new: dict | None) -> bool:
    """Whether a shard's new plan holds at least its old texts: the same, or more (the last shard, under a larger budget)."""
    docs, tokens = old.get("docs"), old.get("tokens")
    return (new is not None and isinstance(docs, list) and new["docs"][: len(docs)] == docs
            and isinstance(tokens, int) and new["tokens"] >= tokens)
