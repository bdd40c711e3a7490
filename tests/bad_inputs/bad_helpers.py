"""Checks every bad-input case shares: no traceback, one error line naming the fix, nothing changed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from click.testing import CliRunner

from prep.cli import main as prep_main
from runtime.cli import main as runtime_main

TINY_CLUSTERS = ["--clusters", "8", "--iterations", "2"]
REPO = Path(__file__).resolve().parents[2]


def snapshot(*paths: Path) -> dict[str, bytes]:
    """Every file under the paths (name -> bytes), to show that nothing changed."""
    files = {}
    for root in paths:
        for p in sorted(root.rglob("*")) if root.exists() else []:
            if p.is_file():
                files[str(p)] = p.read_bytes()
    return files


def error_line(output: str) -> str:
    """The one error line of a command's output (asserting that there is exactly one, no traceback and no usage block)."""
    assert "Traceback" not in output and "Usage:" not in output, output
    lines = [line for line in output.splitlines() if line.startswith("Error")]
    assert len(lines) == 1, output
    return lines[0]


def prep_fails(args: list[str], *must_say: str, code: int = 1, unchanged: tuple[Path, ...] = ()) -> str:
    """Run `prep ARGS` in-process; assert exit code, one error line saying `must_say`, no damage."""
    return command_fails(prep_main, args, *must_say, code=code, unchanged=unchanged)


def runtime_fails(args: list, *must_say: str, code: int = 1, unchanged: tuple[Path, ...] = ()) -> str:
    """Run `runtime ARGS` in-process; assert exit code, one error line saying `must_say`, no damage."""
    return command_fails(runtime_main, args, *must_say, code=code, unchanged=unchanged)


def command_fails(command, args: list, *must_say: str, code: int, unchanged: tuple[Path, ...]) -> str:
    """Run a click command in-process; assert exit code, one error line saying `must_say`, no damage."""
    before = snapshot(*unchanged)
    result = CliRunner().invoke(command, [str(a) for a in args])
    assert result.exit_code == code, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    line = error_line(result.output)
    for text in must_say:
        assert text in line, line
    assert snapshot(*unchanged) == before
    return line


def prep_process(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `prep ARGS` as its own process (for kills and locks), with Ctrl-C's default disposition, as a
    terminal gives it: a test run started in the background of a non-interactive shell ignores SIGINT, and
    its children would inherit that."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "prep", *map(str, args)], cwd=REPO, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def save_tiny_model(path: Path, seed: int, **config) -> Path:
    """A random 2-layer Llama (vocab 256, hidden 64; `config` overrides) and a word-level tokenizer, as an HF directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    config = LlamaConfig(**{**dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
                                   bos_token_id=2, eos_token_id=1), **config})
    LlamaForCausalLM(config).save_pretrained(path)
    vocab = {"<unk>": 0, "</s>": 1, "<s>": 2, **{f"w{i}": i for i in range(3, 256)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="</s>", bos_token="<s>").save_pretrained(path)
    return path
