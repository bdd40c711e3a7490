"""llama.cpp's own EAGLE-3 path on our exported head (smollm2-135m): its converter converts `prep export-drafter`'s
folder and llama-server drafts with the result.

Optional: skipped unless SPECVOCAB_LLAMACPP_SRC names a llama.cpp source tree (convert_hf_to_gguf.py, gguf-py, and
the converter's own requirements importable here) and SPECVOCAB_LLAMACPP_BIN a build with llama-server
(docs/llamacpp-reference.md). CI builds no llama.cpp, so it skips there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from factories import exported_head
from runtime.common.sampling import SamplingParams
from runtime.llamacpp.server import BIN_ENV, Eagle3Draft, LlamaServerDecoder
from runtime.loops.decode import drive
from runtime.models.tokenizer import load_tokenizer

SRC_ENV = "SPECVOCAB_LLAMACPP_SRC"
MODEL = "smollm2-135m-instruct"
DRAFT_VOCAB = 1024
DRAFTS = 4  # tokens llama-server drafts a round
NEW_TOKENS = 32
PROMPT = "def fibonacci(n):\n"

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(not (os.environ.get(SRC_ENV) and os.environ.get(BIN_ENV)),
                       reason=f"no llama.cpp named by {SRC_ENV} (source) and {BIN_ENV} (build); docs/llamacpp-reference.md"),
]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A smollm2 head trained briefly by prep, exported, and converted by llama.cpp's convert_hf_to_gguf.py."""
    root = tmp_path_factory.mktemp("eagle3")
    art, target, head = exported_head(root, MODEL, DRAFT_VOCAB)
    source = Path(os.environ[SRC_ENV])
    out = root / "head.gguf"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(source / "gguf-py"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(head), "--target-model-dir",
                           str(target.path), "--outfile", str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return art, target, out


def test_the_converter_reads_our_layer_ids_and_draft_vocabulary(converted):
    """The GGUF is an eagle3 model reading the layers the head was trained on, with d2t as absolute target ids,
    its matrices in the export's bfloat16 (the converter's default; f16 overflows on gemma3-270m's features)."""
    from gguf import GGMLQuantizationType, GGUFReader

    from artifacts import Artifact

    art, _, out = converted
    artifact = Artifact.open(art)
    params, stage = artifact.stage_params("drafter"), artifact.read_stage("drafter")
    reader = GGUFReader(out)
    assert reader.fields["general.architecture"].contents() == "eagle3"
    assert reader.fields["eagle3.target_layers"].contents() == params["feature_layers"]
    d2t = torch.from_numpy(next(t for t in reader.tensors if t.name == "d2t").data.copy())
    assert torch.equal(d2t, torch.nonzero(stage["t2d"]).view(-1))
    assert d2t.numel() == DRAFT_VOCAB
    matrices = [t for t in reader.tensors if len(t.shape) == 2]  # d2t and the norms are 1-D
    assert matrices and all(t.tensor_type == GGMLQuantizationType.BF16 for t in matrices)


def test_llama_server_drafts_with_the_converted_head(converted):
    """llama-server --spec-type draft-eagle3 (method llamacpp:bin:eagle3) decodes greedily with the head, drafting
    DRAFTS tokens a round, and its replies count what it drafted and kept."""
    _, target, out = converted
    decoder = LlamaServerDecoder(target.gguf_path, frozenset(), threads=1, eagle3=Eagle3Draft(out, max_drafts=DRAFTS))
    prompt = torch.tensor(load_tokenizer(target.path).encode(PROMPT))
    tokens, stats = drive(decoder(prompt, NEW_TOKENS, SamplingParams(), None))
    assert len(tokens) == NEW_TOKENS
    spec = stats.spec  # llama.cpp counts what its draft-eagle3 speculator proposed and what was kept
    assert spec is not None and spec.drafted >= DRAFTS and 0 <= spec.accepted <= spec.drafted
    assert spec.rounds == NEW_TOKENS - 1 - spec.accepted
