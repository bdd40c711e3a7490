"""`prep responses`: the target's own greedy responses to training prompts, as a corpus file for prep traces.

Self-distillation data for the draft head: at run time the head drafts the target's own text, so it
learns best from text the target wrote. Prompts are ShareGPT first turns of the train split
(through the chat template where the model has one; bench prompts come from the held-out split), openings of the Python
standard library's source, and the standard library's functions cut after their docstrings (`pyfunctions`:
a signature and a docstring for the target to implement, the shape of a HumanEval prompt; code that is not
HumanEval, which stays held out). Each response is
decoded with the artifact's default method, whose greedy tokens are the target's own, up to `batch`
prompts at a time through the server's continuous batching (runtime.serve.together: each prompt's tokens
are the ones it gets alone, while the batch shares the target's forwards). The file is
a JSON list of {"text": prompt text + response}, written atomically once every prompt is done.
Until then each finished response is appended to OUT.partial (JSON lines after a line of the
settings), so an interrupted run resumes where it stopped: greedy responses do not depend on when
they were decoded.
"""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Iterator
from contextlib import closing
from itertools import islice
from pathlib import Path

from tqdm import tqdm

from artifacts.atomic import atomic_write_bytes
from prep.core_pool import map_on_cores, worker_count
from prep.traces import CODE_CORPUS, stdlib_sources, stdlib_texts
from runtime.serve.together import generate_together
from runtime.text.data import sharegpt_prompts

CODE_PROMPT_CHARS = 600  # a source file's opening: imports, a docstring, the first definitions
FUNCTIONS_SOURCE = "pyfunctions"
FUNCTIONS_PER_FILE = 2  # spread the prompts over the library
MAX_IMPORT_LINES = 6
NEW_TOKENS = 128  # per response, by default: about a bench answer
POOL_MIN_TOKENS = 1024  # tokens to decode before workers pay: ~20 s at one thread, a worker starts in ~5 s
BATCH = 8  # prompts decoded at once by each process
ROUNDS_PER_TASK = 2  # a task holds this many batches of prompts: the batch stays full but for the task's last ones
SOURCES = ("sharegpt", CODE_CORPUS, FUNCTIONS_SOURCE)


def training_prompts(source: str, count: int) -> list[tuple[str, bool]]:
    """(prompt, through the chat template?) pairs: ShareGPT's train split, the standard library's openings or its functions."""
    if source == "sharegpt":
        return [(text, True) for text in sharegpt_prompts(count, split="train")]
    if source == CODE_CORPUS:
        return [(text[:CODE_PROMPT_CHARS], False) for text in islice(stdlib_texts(), count)]
    if source == FUNCTIONS_SOURCE:
        return [(text, False) for text in islice(function_prompts(stdlib_sources()), count)]
    raise ValueError(f"unknown prompt source {source!r}: use {' or '.join(SOURCES)}")


def function_prompts(sources) -> Iterator[str]:
    """HumanEval-shaped prompts from Python sources: a file's imports, then one of its top-level
    functions up to the end of its docstring (FUNCTIONS_PER_FILE per file, in file order)."""
    for source in sources:
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            continue
        lines = source.splitlines()
        imports = [ast.get_source_segment(source, node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        header = "\n".join(imports[:MAX_IMPORT_LINES])
        documented = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and ast.get_docstring(node) and len(node.body) > 1]
        for node in documented[:FUNCTIONS_PER_FILE]:
            function = "\n".join(lines[node.lineno - 1 : node.body[0].end_lineno])  # def ... through the docstring
            yield f"{header}\n\n\n{function}\n" if header else f"{function}\n"


def partial_path(out: str | Path) -> Path:
    """Where write_responses keeps the responses finished so far: OUT.partial."""
    out = Path(out)
    return out.with_name(out.name + ".partial")


def finished_responses(partial: Path, settings: dict) -> list[dict]:
    """The responses a run of the same settings finished ({"text", "tokens"} each), up to the first torn line;
    none, with a line saying so, if another run's settings wrote the file."""
    try:
        lines = partial.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as e:
        print(f"{partial}: unreadable ({e}), started over", file=sys.stderr)
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            break  # a line cut by the interrupt, and whatever follows it
    if not records or records[0] != settings:
        print(f"{partial}: responses of other settings, started over", file=sys.stderr)
        return []
    finished = records[1:]
    if not all(isinstance(r, dict) and isinstance(r.get("text"), str) and isinstance(r.get("tokens"), int)
               for r in finished):
        print(f"{partial}: not a responses file of this version, started over", file=sys.stderr)
        return []
    return finished


def write_responses(engine, source: str, count: int, max_new_tokens: int, out: str | Path,
                    workers: int | None = 1, batch: int = BATCH) -> int:
    """Decode `count` prompts of `source` greedily and write the corpus file, resuming OUT.partial; returns its token count.

    workers: 1 decodes with `engine`; more decode on that many single-threaded processes, one per core
    (prep.core_pool), each loading the engine's artifact: the same tokens, written in the same order.
    None: prep.core_pool.worker_count's choice for the job.
    batch: prompts each process decodes at once (the same tokens whatever it is).
    """
    prompts = training_prompts(source, count)
    templated = bool(getattr(engine.tokenizer, "chat_template", None))  # a base model (gemma3-270m) has none
    settings = {"model": engine.session.model.info.name, "source": source, "count": count,
                "max_new_tokens": max_new_tokens, "chat_template": templated}
    partial = partial_path(out)
    finished = finished_responses(partial, settings)
    lines = [json.dumps(r, ensure_ascii=False) + "\n" for r in [settings, *finished]]
    atomic_write_bytes(partial, "".join(lines).encode())  # without a torn last line
    with partial.open("a", encoding="utf-8") as log:
        asks = [(prompt, chat and templated, max_new_tokens) for prompt, chat in prompts[len(finished):]]
        per_task = batch * ROUNDS_PER_TASK
        tasks = [(asks[start:start + per_task], batch) for start in range(0, len(asks), per_task)]
        answers = map_on_cores(worker_count(workers, len(asks) * max_new_tokens, POOL_MIN_TOKENS), respond, tasks,
                               engine, load_engine, (str(engine.session.artifact.path),))
        with closing(answers), tqdm(desc="responses", unit="prompt", file=sys.stderr, initial=len(finished),
                                    total=len(prompts)) as progress:  # an interrupt stops the workers
            for task_answers in answers:
                for answer in task_answers:
                    finished.append(answer)
                    log.write(json.dumps(answer, ensure_ascii=False) + "\n")
                log.flush()
                progress.update(len(task_answers))
    texts = [{"text": r["text"]} for r in finished]
    atomic_write_bytes(Path(out), (json.dumps(texts, ensure_ascii=False) + "\n").encode())
    partial.unlink()
    return sum(r["tokens"] for r in finished)


def load_engine(artifact: str):
    """A worker's engine: the artifact and its own model, decoding on one thread."""
    from runtime import api

    return api.load(artifact, threads=1, progress=False)


def respond(engine, task: tuple[list[tuple[str, bool, int]], int]) -> list[dict]:
    """The greedy responses to a task's asks (prompt, through the chat template?, max new tokens), decoded
    its batch at a time: a {"text", "tokens"} each, in order."""
    asks, batch = task
    prompts = [engine.encode(prompt, chat).tolist() for prompt, chat, _ in asks]
    plans = [engine.prepare(ids, max_new_tokens=max_new_tokens) for ids, (_, _, max_new_tokens) in zip(prompts, asks)]
    responses = generate_together(engine, plans, max_batch=batch)
    return [{"text": engine.tokenizer.decode(ids + new, skip_special_tokens=False), "tokens": len(ids) + len(new)}
            for ids, new in zip(prompts, responses)]
