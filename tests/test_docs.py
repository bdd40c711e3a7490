"""The docs (README.md and docs/) against the tree: the README's commands parse as the CLIs parse them,
its Python compiles and calls the API as it is, and every command, option, method, code name, path and
link the docs mention exists; results blocks generated from committed records match bench-summary.

Static checks only (no model is loaded, no command runs), so a renamed function, option or file fails
here rather than in a user's first five minutes."""

from __future__ import annotations

import ast
import inspect
import re
import shlex
import subprocess
from functools import cache
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
MAX_README_LINES = 250

# The two commands CI and users copy from the top of the README: kept byte for byte.
MAIN_JOB = ("python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 && .venv/bin/pip install -q -e '.[test]' "
            "&& .venv/bin/prep import gemma3-270m && .venv/bin/prep all gemma3-270m -o art/g270 && .venv/bin/runtime "
            "generate art/g270 --prompt \"def fibonacci(n):\" --max-new-tokens 64")
TEST_JOB = ("python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 && .venv/bin/pip install -q -e '.[test]' "
            "&& .venv/bin/python -m pytest -q")

FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```[ \t]*$", re.M | re.S)
LANGUAGES = {"sh", "python", "text"}  # sh and python blocks are checked; text blocks are grammar and layout
OTHER_PROGRAMS = {"python3", "python", "pip", "git", "curl"}  # programs a sh block may run besides prep and runtime
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
PLACEHOLDER = re.compile(r"[<>\[\]A-Z]|\.\.\.|…|\|")  # art/<g270|qwen>, [--traces TR], M, ...: not a literal value

# Names the docs cite from outside this tree (llama.cpp, llama-cpp-python, the C library, CPU flags).
EXTERNAL_NAMES = {"__AMX_INT8__", "logits_all", "LlamaPromptLookupDecoding", "AVX512_VNNI", "AVX_VNNI", "V_bake",
                  "Eagle3DraftModel", "Eagle3Speculator", "Eagle3LlamaForCausalLM",  # llama.cpp converter names
                  "norm_before_fc", "norm_before_residual"}  # and config keys
EXTERNAL_FILES = {"convert_hf_to_gguf.py"}  # llama.cpp's, named where the docs say how to use its tools


def page_text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def code_blocks(path: Path, language: str | None = None) -> list[tuple[str, str]]:
    """(language, body) of each fenced block of a page, optionally of one language."""
    return [(lang, body) for lang, body in FENCE.findall(page_text(path)) if language in (None, lang)]


def prose(path: Path) -> str:
    """A page without its fenced blocks."""
    return FENCE.sub("", page_text(path))


def inline_spans(path: Path) -> list[str]:
    """The text of every `inline code` span of a page's prose (a span may wrap onto the next line)."""
    return [" ".join(span.split()) for span in re.findall(r"`([^`]{1,400})`", prose(path))]


def shell_commands(body: str) -> list[list[str]]:
    """The commands of a sh block, each as argv without its leading VAR=value assignments: lines joined at
    a trailing backslash, comments dropped, split at &&, ||, | and ;."""
    commands = []
    for line in body.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        current: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", "||", "|", ";"):
                while current and ENV_ASSIGNMENT.match(current[0]):
                    current.pop(0)
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(word)
    return commands


@cache
def cli_groups() -> dict[str, click.Group]:
    from prep.cli import main as prep_main
    from runtime.cli import main as runtime_main

    return {"runtime": runtime_main, "prep": prep_main}


def subcommand(argv: list[str]) -> tuple[click.Group, click.Command]:
    """The click group and command an argv of prep or runtime names; a test failure if it names none."""
    program = Path(argv[0]).name
    group = cli_groups()[program]
    assert len(argv) > 1, f"{' '.join(argv)}: no command given to {program}"
    command = group.commands.get(argv[1])
    assert command is not None, f"{' '.join(argv)}: {program} has no command {argv[1]!r} (it has {sorted(group.commands)})"
    return group, command


def option_names(command: click.Command) -> set[str]:
    return {name for param in command.params for name in (*param.opts, *param.secondary_opts)} | {"--help", "-h"}


def check_options_and_methods(argv: list[str]) -> None:
    """Each option of a prep or runtime command line is one the command takes, and each literal method name
    given to --method / --methods parses in the grammar (placeholders such as <g270|qwen> are left alone)."""
    from runtime.methods import parse_method

    _, command = subcommand(argv)
    names = option_names(command)
    for i, word in enumerate(argv[2:], start=2):
        if re.match(r"^--?[A-Za-z]", word):
            option = word.split("=", 1)[0]
            assert option in names, f"{' '.join(argv)}: {argv[0]} {argv[1]} has no option {option} (it has {sorted(names)})"
            if option in ("--method", "--methods") and i + 1 < len(argv) and not PLACEHOLDER.search(argv[i + 1]):
                for name in argv[i + 1].split(","):
                    try:
                        parse_method(name)
                    except ValueError as error:
                        pytest.fail(f"{' '.join(argv)}: {error}")


def parse_command_line(argv: list[str]) -> None:
    """Parse a whole prep or runtime command line as the CLI would before running it: every option, argument
    and value converted and checked (types and callbacks), nothing invoked."""
    group, command = subcommand(argv)
    parent = click.Context(group, info_name=Path(argv[0]).name)
    try:
        with command.make_context(argv[1], list(argv[2:]), parent=parent):
            pass
    except click.exceptions.Exit:  # --help
        pass
    except click.ClickException as error:
        pytest.fail(f"{' '.join(argv)}: {error.format_message()}")


def readme_commands() -> list[list[str]]:
    return [argv for _, body in code_blocks(README, "sh") for argv in shell_commands(body)]


def docs_commands() -> list[list[str]]:
    """Every prep or runtime command line in the docs: sh blocks and inline spans of every page."""
    found = [argv for page in PAGES for _, body in code_blocks(page, "sh") for argv in shell_commands(body)]
    for page in PAGES:
        for span in inline_spans(page):
            if re.match(r"^(\S+=\S+ )*(prep|runtime) [a-z]", span) and not span.endswith("..."):
                found += [argv for argv in shell_commands(span)]
    return [argv for argv in found if Path(argv[0]).name in ("prep", "runtime")]


def test_readme_is_short():
    lines = page_text(README).count("\n")
    assert lines <= MAX_README_LINES, f"README.md is {lines} lines, more than {MAX_README_LINES}: move detail to docs/"


def test_the_two_setup_commands_open_the_readme_unchanged():
    first_two = [body.strip() for _, body in code_blocks(README)[:2]]
    assert first_two == [MAIN_JOB, TEST_JOB]


def test_every_code_block_says_its_language():
    for page in PAGES:
        text = page_text(page)
        assert text.count("```") % 2 == 0, f"{page}: an unclosed ``` block"
        for lang, _ in FENCE.findall(text):
            assert lang in LANGUAGES, f"{page.relative_to(ROOT)}: a ```{lang} block; use one of {sorted(LANGUAGES)}"


def test_readme_commands_run_only_known_programs():
    for argv in readme_commands():
        program = Path(argv[0]).name
        assert program in OTHER_PROGRAMS | {"prep", "runtime"}, f"README runs {argv[0]!r}, not a known program"


def test_readme_commands_parse_as_the_clis_parse_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # output paths (--json) are checked against an empty folder
    commands = [argv for argv in readme_commands() if Path(argv[0]).name in ("prep", "runtime")]
    assert len(commands) >= 10
    for argv in commands:
        parse_command_line(argv)


def test_docs_commands_name_real_commands_options_and_methods():
    commands = docs_commands()
    assert len(commands) >= 30
    for argv in commands:
        check_options_and_methods(argv)


def test_pytest_command_in_the_readme_is_the_ci_one():
    assert "python -m pytest -q" in page_text(ROOT / ".ci" / "run")
    assert [".venv/bin/python", "-m", "pytest", "-q"] in readme_commands()


# ---- Python snippets


@cache
def api_objects() -> list:
    """What a README snippet may call or read: runtime.api and the types its calls return."""
    from runtime import api
    from runtime.common.sampling import SamplingParams
    from runtime.common.stats import DecodeStats, HeadStats, SpecStats

    return [api, api.Engine, api.Generation, DecodeStats, SpecStats, HeadStats, SamplingParams]


def has_attribute(owner, name: str) -> bool:
    """Whether `owner` (a module or class) has `name`: an attribute, a dataclass field, or one its __init__ sets."""
    if hasattr(owner, name) or name in getattr(owner, "__annotations__", {}):
        return True
    return inspect.isclass(owner) and re.search(rf"\bself\.{name}\s*[:=]", inspect.getsource(owner)) is not None


def binds(function, call: ast.Call, bound_method: bool) -> bool:
    """Whether `call`'s positional count and keyword names fit `function`'s signature (`bound_method`: the
    function is a class's, called on an instance, so `self` comes first)."""
    try:
        inspect.signature(function).bind(*([None] * (len(call.args) + bound_method)),
                                         **{k.arg: None for k in call.keywords if k.arg})
    except TypeError:
        return False
    return True


def check_snippet(source: str) -> list[str]:
    """Problems of a README Python snippet: imports that do not exist, API calls whose arguments do not fit,
    attributes no API type has."""
    import importlib
    import importlib.util

    problems = []
    tree = ast.parse(source)
    imported = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                if hasattr(module, "__path__") and importlib.util.find_spec(f"{node.module}.{alias.name}"):
                    importlib.import_module(f"{node.module}.{alias.name}")
                if not has_attribute(module, alias.name):
                    problems.append(f"from {node.module} import {alias.name}: no such name")
                else:
                    imported[alias.asname or alias.name] = getattr(module, alias.name)
    calls = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in imported:
            target = imported[node.func.id]
            if callable(target) and not binds(target.__init__ if inspect.isclass(target) else target, node,
                                              inspect.isclass(target)):
                problems.append(f"{ast.unparse(node)}: the arguments do not fit {node.func.id}")
        if not isinstance(node, ast.Attribute):
            continue
        owners = [owner for owner in api_objects() if has_attribute(owner, node.attr)]
        if not owners:
            problems.append(f"{ast.unparse(node)}: no API type has {node.attr!r}")
        elif id(node) in calls:
            call = next(c for c in ast.walk(tree) if isinstance(c, ast.Call) and c.func is node)
            functions = [(getattr(o, node.attr), inspect.isclass(o)) for o in owners if callable(getattr(o, node.attr, None))]
            if functions and not any(binds(f, call, bound) for f, bound in functions):
                problems.append(f"{ast.unparse(call)}: the arguments do not fit {node.attr}")
    return problems


def test_python_in_the_docs_compiles_and_calls_the_api_as_it_is():
    snippets = [(page, body) for page in PAGES for _, body in code_blocks(page, "python")]
    assert any(page == README for page, _ in snippets), "the README shows how to call specvocab from Python"
    for page, body in snippets:
        compile(body, str(page.relative_to(ROOT)), "exec")
        if "from runtime" in body or "import runtime" in body:  # other snippets call other APIs (an OpenAI client)
            assert check_snippet(body) == [], page.relative_to(ROOT)


def test_the_snippet_check_catches_a_renamed_call_and_a_wrong_keyword():
    assert check_snippet("from runtime import api\nengine = api.load('art/g270')\nengine.generate('x', max_tokens=3)")
    assert check_snippet("from runtime import api\nrun = api.load('a').generate('x')\nrun.stats.tokens_per_second")
    assert not check_snippet("from runtime import api\nrun = api.load('a').generate('x', seed=1)\nrun.stats.tokens_per_s")


# ---- code names, paths and links


@cache
def tracked_files() -> list[str]:
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True)
    if listed.returncode:
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [name for name in listed.stdout.splitlines() if (ROOT / name).exists()]


@cache
def source_text(tests: bool) -> str:
    """The product's source (or the tests'), where a code name the docs mention must occur."""
    kinds = (".py", ".h", ".cpp", ".toml")
    names = [n for n in tracked_files() if n.endswith(kinds) and n.startswith("tests/") == tests
             and n != "tests/test_docs.py"] + (
        [".ci/run"] if not tests else [])
    return "\n".join((ROOT / name).read_text(encoding="utf-8", errors="replace") for name in names)


@cache
def module_names(path: Path) -> tuple[set[str], dict[str, set[str]]]:
    """A module's top-level names, and each top-level class's attributes (defs, assignments, self.x)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top, classes = set(), {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            top.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                top |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            top |= {(a.asname or a.name).split(".")[0] for a in node.names}
        if isinstance(node, ast.ClassDef):
            members = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            members |= {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
            members |= {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
            members |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                        and n.value.id == "self"}
            classes[node.name] = members
    return top, classes


def resolve_dotted(name: str) -> str | None:
    """None if `name` (runtime.methods.parse_method, runtime.kernels.PAYING_DRAFTS, runtime.api) names a
    module of the tree, or a top-level name of one (or an attribute of such a class); else the problem."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        module = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
        if module.exists():
            rest = parts[cut:]
            if not rest:
                return None
            top, classes = module_names(module)
            if rest[0] not in top:
                return f"{'.'.join(parts[:cut])} has no {rest[0]}"
            if len(rest) > 1 and rest[0] in classes and rest[1] not in classes[rest[0]]:
                return f"{'.'.join(parts[:cut + 1])} has no {rest[1]}"
            return None
    return "no such module"


IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def is_code_name(word: str) -> bool:
    """Whether a backticked word reads as a code name (snake_case, CamelCase, CONSTANT_CASE), not a word of
    prose, a method or an option (ar, csv, lookup, int8)."""
    return bool(IDENTIFIER.match(word)) and ("_" in word.strip("_") or word.startswith("_")
                                             or re.search(r"[a-z][A-Z]|^[A-Z][a-z]+$|^[A-Z][a-z]+[A-Z]", word) is not None)


def name_problems(span: str) -> list[str]:
    """Why a backticked span that names code, a path of the tree or a method does not resolve ([] if it does)."""
    from runtime.methods import ALIASES, METHODS, parse_method

    if re.match(r"^(artifacts|runtime|prep|recipes|tests|docs|\.ci)/[\w./-]*$", span):
        return [] if (ROOT / span).exists() else [f"`{span}`: no such path in the tree"]
    if re.match(r"^[\w-]+\.(py|h|cpp|toml)$", span):
        known = span in EXTERNAL_FILES or any(Path(n).name == span for n in tracked_files())
        return [] if known else [f"`{span}`: no such file in the tree"]
    if re.match(r"^(runtime|prep|artifacts)(\.\w+)+$", span):
        problem = resolve_dotted(span)
        return [f"`{span}`: {problem}"] if problem else []
    method = re.match(r"^([a-z0-9]+)(:[a-z0-9=.]+)*(\+csv(:[a-z0-9]+)?)?$", span)
    if method and (method.group(1) in METHODS or method.group(1) in ALIASES) and "..." not in span:
        if ":" not in span and "+" not in span:
            return []  # a method family (spec, mjsd): registered, so it exists
        try:
            parse_method(span)
        except ValueError as error:
            return [f"`{span}`: {error}"]
        return []
    name = re.sub(r"'s$", "", re.split(r"[<(\[ ]", span, maxsplit=1)[0])
    if " " in span and not re.match(r"^[\w.]+[<(\[]", span):
        return []  # a phrase or a command, not a name
    problems = []
    for word in name.split("."):
        if word in EXTERNAL_NAMES or not is_code_name(word):
            continue
        haystacks = [source_text(tests=True)] if word.startswith("test_") else [source_text(False), source_text(True)]
        if not any(re.search(rf"(?<![\w]){re.escape(word)}(?![\w])", text) for text in haystacks):
            problems.append(f"`{span}`: {word} occurs nowhere in the {'tests' if word.startswith('test_') else 'tree'}")
    return problems


def test_every_code_name_path_and_method_in_the_docs_exists():
    problems = [f"{page.relative_to(ROOT)}: {problem}" for page in PAGES for span in inline_spans(page)
                for problem in name_problems(span)]
    assert problems == []


def test_the_name_check_catches_a_renamed_function_a_moved_file_and_a_bad_method():
    assert name_problems("stream_rounds") == [] and name_problems("run_rounds")
    assert name_problems("runtime/loops/speculative.py") == [] and name_problems("runtime/rounds.py")
    assert name_problems("runtime.methods.parse_method") == [] and name_problems("runtime.methods.parse_name")
    assert name_problems("spec:lookup+csv:screen4") == [] and name_problems("spec:lookup+csv:screen9")


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors for a page's headings (lower case, punctuation dropped, spaces as hyphens)."""
    anchors, seen = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", prose(path), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_every_link_in_the_docs_resolves():
    problems = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(page)):
            if re.match(r"^[a-z]+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not path.exists():
                problems.append(f"{where}: no such file")
            elif anchor and (path.suffix != ".md" or anchor not in heading_anchors(path)):
                problems.append(f"{where}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert problems == []


def test_docs_cite_no_bench_output_folder_that_is_not_in_the_repository():
    for page in PAGES:
        stale = re.findall(r"bench-out/w\d+\S*", page_text(page))
        assert not stale, f"{page.relative_to(ROOT)} cites {stale}: name the commit and the command instead"


# ---- results pages generated from records


def test_generated_results_blocks_equal_bench_summary_of_their_committed_records(monkeypatch):
    from runtime.bench.summary import PAGE_BLOCK, summary_markdown

    monkeypatch.chdir(ROOT)  # the records' paths in the markers are relative to the repository
    checked = 0
    for page in PAGES:
        for block in PAGE_BLOCK.findall(page_text(page)):
            opening, _, rest = block.partition("\n")
            body = rest.rsplit("\n", 1)[0].strip()
            generated = re.match(r"<!-- bench-summary: runtime bench-summary (.+?) -->$", opening)
            if generated is None:
                assert "transcribed by hand" in opening, f"{page.relative_to(ROOT)}: a block that says neither " \
                                                         "which records made it nor that it was transcribed by hand"
                continue
            records = generated.group(1).split()
            missing = [r for r in records if not (ROOT / r).is_file()]
            assert not missing, f"{page.relative_to(ROOT)}: generated from {missing}, which are not in the repository"
            assert body == summary_markdown(records), f"{page.relative_to(ROOT)}: rerun {opening[5:-4]} --page {page}"
            checked += 1
    assert checked >= 1  # docs/reproducing.md's example, from tests/data/bench-sample.json
