"""Bad inputs of the training-data commands (prep traces, train-router, gp-basis, bake-onedecode, all --with-router):
damaged traces, bad trainer flags and option values, reruns that would lose traces, Ctrl-C, and quiet output."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
from click.testing import CliRunner

from artifacts import Artifact
from bad_helpers import prep_fails
from prep.cli import main as prep_main
from prep.trace_files import INDEX_FILE, SHARD_NAME, shard_checksum

TRACES = ["--shard-tokens", 400, "--max-tokens", 2500]
ROUTER = ["--clusters", 8, "--max-steps", 3, "--width", 16, "--batch-size", 64, "--accelerator", "cpu"]


def prep_ok(args: list) -> str:
    result = CliRunner().invoke(prep_main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """80 texts of 8 to 40 words of the tiny tokenizer: five 400-token shards, every split."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("corpus") / "corpus.json"
    path.write_text(json.dumps([{"text": " ".join(f"w{rng.randrange(4, 256)}" for _ in range(rng.randrange(8, 40)))}
                                for _ in range(80)]))
    return path


@pytest.fixture(scope="module")
def built_traces(tiny_model: Path, corpus: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("traces") / "tr"
    prep_ok(["traces", tiny_model, "--corpus", corpus, "-o", out, *TRACES])
    return out


@pytest.fixture
def tr(built_traces: Path, tmp_path: Path) -> Path:
    """A private copy of the built traces, to damage."""
    return Path(shutil.copytree(built_traces, tmp_path / "tr"))


def shard_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if SHARD_NAME.fullmatch(p.name))


def interrupt_at_shard(monkeypatch, number: int):
    """Make prep traces stop as at Ctrl-C when it starts its `number`-th shard; return the real run_shard."""
    from prep import traces

    real, calls = traces.run_shard, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == number:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(traces, "run_shard", interrupted)
    return real


# 1. Damaged traces: one line naming the file and the fix, from every reader.

def test_a_truncated_shard_is_named_and_a_rerun_redoes_it(tr: Path, art: Path, tiny_model: Path, corpus: Path):
    shard = tr / "shard-00001.safetensors"
    whole = shard.read_bytes()
    shard.write_bytes(whole[:1000])
    prep_fails(["bake-onedecode", art, "--traces", tr], f"{shard} is damaged", "rerun the prep traces command",
               unchanged=(art,))
    prep_fails(["gp-basis", art, "--traces", tr], f"{shard} is damaged", unchanged=(art,))
    prep_ok(["traces", tiny_model, "--corpus", corpus, "-o", tr, *TRACES])
    assert shard.read_bytes() == whole


def test_a_shard_that_fails_its_checksum_is_named_and_a_rerun_redoes_it(tr: Path, art: Path, tiny_model: Path, corpus: Path):
    """A byte changed inside a shard's tensor data is named by every reader, and a rerun writes the shard again.

    Its header, and so safetensors, are still fine: the sha256 its index entry records is what refuses it."""
    shard = tr / "shard-00002.safetensors"
    whole = shard.read_bytes()
    assert json.loads((tr / INDEX_FILE).read_text())["shards"][2]["bytes"] == len(whole)
    damaged = bytearray(whole)
    damaged[-5] ^= 0x55  # the last tensor's data
    shard.write_bytes(bytes(damaged))
    for args in (["bake-onedecode", art, "--traces", tr], ["gp-basis", art, "--traces", tr]):
        prep_fails(args, f"{shard} is damaged (shard-00002.safetensors fails its sha256 checksum)",
                   "rerun the prep traces command", unchanged=(art,))
    prep_ok(["traces", tiny_model, "--corpus", corpus, "-o", tr, *TRACES])
    assert shard.read_bytes() == whole


@pytest.mark.parametrize("index, says", [
    ("[1, 2]", "is not a traces index (a JSON list, not an object)"),
    ('{"shards": "x"}', "is not a traces index (format None"),
    ('{"format": 1, "model": "tiny", "vocab_size": 256, "shards": "x"}', 'is not a traces index (its "shards" are not a list'),
    ('{"format": 1, "model": "tiny", "vocab_size": 256, "shards": [{"file": "../../x"}]}', 'is not a traces index (its "shards" are not a list'),
    ('{"format": 1, "shards": [', "is damaged (Expecting"),
    ('{"format": 1, "model": "tiny", "vocab_size": 256, "shards": [{"file": "shard-00000.safetensors", "sha256": "ab"}]}',
     "is not a traces index (a shard's sha256 and bytes are not text and an integer >= 0, nor both absent"),
], ids=["list", "no-format", "shards-not-a-list", "shard-outside", "not-json", "half-a-checksum"])
def test_a_damaged_index_is_named_with_the_rebuild(tr: Path, art: Path, tiny_model: Path, corpus: Path, index: str,
                                                   says: str):
    (tr / INDEX_FILE).write_text(index)
    fix = f"`prep traces MODEL -o {tr} --force`"
    for args in (["bake-onedecode", art, "--traces", tr], ["gp-basis", art, "--traces", tr],
                 ["train-router", art, "--traces", tr, *ROUTER],
                 ["traces", tiny_model, "--corpus", corpus, "-o", tr, *TRACES]):
        prep_fails(args, f"{tr / INDEX_FILE} {says}", fix, unchanged=(art, tr))
    prep_ok(["traces", tiny_model, "--corpus", corpus, "-o", tr, *TRACES, "--force"])
    assert json.loads((tr / INDEX_FILE).read_text())["format"] == 1


def test_an_interrupted_repair_keeps_the_later_shards_listed(tr: Path, tiny_model: Path, corpus: Path, monkeypatch):
    """While one shard is rewritten the index lists the intact ones after it too, so a rerun after Ctrl-C redoes one."""
    from prep import traces

    listed = [e["file"] for e in json.loads((tr / INDEX_FILE).read_text())["shards"]]
    (tr / listed[1]).write_bytes(b"damaged")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(traces, "run_shard", interrupted)
    result = CliRunner().invoke(prep_main, [str(a) for a in ["traces", tiny_model, "--corpus", corpus, "-o", tr, *TRACES]])
    assert result.exit_code == 130, result.output
    assert [e["file"] for e in json.loads((tr / INDEX_FILE).read_text())["shards"]] == listed[:1] + listed[2:]


def test_a_missing_shard_is_named(tr: Path, art: Path):
    (tr / "shard-00002.safetensors").unlink()
    prep_fails(["bake-onedecode", art, "--traces", tr], "shard-00002.safetensors is missing", unchanged=(art, tr))


# 2, 3. Trainer flags: checked before any work; strategies that re-run the command are refused.

@pytest.mark.parametrize("flags, says", [
    (["--devices", "abc"], "--devices takes a number of devices such as 1 or 2, or auto; got 'abc'"),
    (["--devices", "0"], "--devices takes a number"),
    (["--strategy", "ddp", "--devices", "2"], "--strategy ddp is not supported: use auto or ddp_spawn"),
    (["--strategy", "fsdp"], "use auto or ddp_spawn"),
    (["--accelerator", "tpu"], "--accelerator takes auto, cpu, gpu"),
    (["--precision", "abc"], "Lightning refuses --precision abc"),
], ids=["devices-text", "devices-0", "ddp", "fsdp", "accelerator", "precision"])
def test_bad_trainer_flags(art: Path, built_traces: Path, flags: list, says: str):
    prep_fails(["train-router", art, "--traces", built_traces, *flags], says, unchanged=(art, built_traces))


@pytest.mark.parametrize("command", ["train-router", "cluster"])
def test_a_seed_out_of_range_is_refused_before_the_model_loads(art: Path, built_traces: Path, tiny_model: Path, command: str):
    args = ["train-router", art, "--traces", built_traces] if command == "train-router" else ["cluster", tiny_model, "-o", art]
    prep_fails([*args, "--seed", "-1"], "'--seed': give an integer in [0, 4294967295], not '-1'", code=2,
               unchanged=(art, built_traces))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_gpu_accelerator_without_a_gpu(art: Path, built_traces: Path):
    prep_fails(["train-router", art, "--traces", built_traces, "--accelerator", "gpu"],
               "--accelerator gpu: no GPU is visible here; use --accelerator cpu", unchanged=(art, built_traces))


def test_several_devices_train_in_spawned_processes():
    from prep.router_trainer import lightning_flags

    assert lightning_flags("2", "cpu")["strategy"] == "ddp_spawn"  # Lightning alone would pick ddp, which re-runs
    assert lightning_flags("1", "cpu")["strategy"] == "auto"
    assert lightning_flags("2", "cpu", strategy="ddp_spawn")["devices"] == 2


def test_the_help_shows_only_strategies_that_work():
    text = CliRunner().invoke(prep_main, ["train-router", "--help"]).output
    assert "--strategy ddp " not in text and "--num-nodes" not in text and "ddp_spawn" in text


# 4. Bad corpora: refused before the model loads, leaving no folder behind.

@pytest.mark.parametrize("content, says", [
    (None, "unknown corpus"),
    ("[]", "holds no text"),
    ("[{", "cannot read prompts"),
    ('[{"text": "w5"}]', "holds no text of 2 tokens or more"),
], ids=["missing", "empty", "not-json", "one-token"])
def test_a_bad_corpus_leaves_no_folder(tmp_path: Path, tiny_model: Path, content: str | None, says: str):
    corpus = tmp_path / "corpus.json"
    if content is not None:
        corpus.write_text(content)
    prep_fails(["traces", tiny_model, "--corpus", corpus, "-o", tmp_path / "x" / "a" / "b"], says)
    assert not (tmp_path / "x").exists()


# 5. A rerun that would remove or shorten traces needs --force, which leaves no orphan shard.

def test_a_smaller_budget_needs_force_and_leaves_no_orphan(tr: Path, tiny_model: Path, corpus: Path):
    smaller = ["traces", tiny_model, "--corpus", corpus, "-o", tr, "--shard-tokens", 400, "--max-tokens", 1000]
    prep_fails(smaller, "would remove or shorten", "pass --force", unchanged=(tr,))
    prep_ok([*smaller, "--force"])
    index = json.loads((tr / INDEX_FILE).read_text())
    assert shard_files(tr) == [e["file"] for e in index["shards"]] and index["max_tokens"] == 1000


def test_force_with_the_same_settings_keeps_the_intact_shards(tr: Path, tiny_model: Path, corpus: Path):
    """prep all --with-router --force passes --force on: it must not re-trace a corpus that is already done."""
    written = {path.name: path.stat().st_mtime_ns for path in tr.glob("shard-*.safetensors")}
    prep_ok(["traces", tiny_model, "--corpus", corpus, "-o", tr, *TRACES, "--force"])
    assert {path.name: path.stat().st_mtime_ns for path in tr.glob("shard-*.safetensors")} == written


def test_a_larger_budget_adds_traces_and_keeps_the_others(tiny_model: Path, corpus: Path, tmp_path: Path):
    out = tmp_path / "tr"
    prep_ok(["traces", tiny_model, "--corpus", corpus, "-o", out, "--shard-tokens", 400, "--max-tokens", 1000])
    first = (out / "shard-00000.safetensors").read_bytes()
    written = (out / "shard-00000.safetensors").stat().st_mtime_ns
    prep_ok(["traces", tiny_model, "--corpus", corpus, "-o", out, "--shard-tokens", 400, "--max-tokens", 1500])
    assert (out / "shard-00000.safetensors").read_bytes() == first
    assert (out / "shard-00000.safetensors").stat().st_mtime_ns == written  # kept, not traced again
    assert sum(e["tokens"] for e in json.loads((out / INDEX_FILE).read_text())["shards"]) == 1500


# 6. A traces folder of its own, written by one run at a time.

def test_traces_into_an_artifact_are_refused(art: Path, tiny_model: Path, corpus: Path):
    prep_fails(["traces", tiny_model, "--corpus", corpus, "-o", art], "is a specvocab artifact",
               "traces go in a folder of their own", unchanged=(art,))


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "force"])
def test_an_artifact_into_a_traces_folder_is_refused(tr: Path, tiny_model: Path, force: list):
    prep_fails(["cluster", tiny_model, "-o", tr, "--clusters", 8, "--iterations", 2, *force],
               f"{tr} holds traces (index.json); an artifact goes in a folder of its own: choose another -o", unchanged=(tr,))


def test_traces_into_a_file_are_refused(tmp_path: Path, tiny_model: Path, corpus: Path):
    (tmp_path / "file").write_text("x")
    prep_fails(["traces", tiny_model, "--corpus", corpus, "-o", tmp_path / "file"], "is a file", "choose another -o",
               unchanged=(tmp_path,))


def test_a_traces_folder_another_run_writes_is_refused(tr: Path, tiny_model: Path, corpus: Path):
    (tr / ".lock").write_text(f"{os.getppid()}\n")  # a live process
    prep_fails(["traces", tiny_model, "--corpus", corpus, "-o", tr, *TRACES, "--force"],
               f"being written by another prep run (pid {os.getppid()})", unchanged=(tr,))


# 7. Degenerate stages are refused before anything is written.

def test_traces_without_a_train_split_bake_no_table(tr: Path, art: Path):
    prep_ok(["bake-onedecode", art, "--traces", tr])  # a good table, which --force must not replace by an empty one
    index = json.loads((tr / INDEX_FILE).read_text())
    for entry in index["shards"]:
        tensors = safetensors.torch.load_file(str(tr / entry["file"]))
        tensors["split"] = torch.full_like(tensors["split"], 2)  # all held out
        safetensors.torch.save_file(tensors, str(tr / entry["file"]))
        entry.update(shard_checksum(tr / entry["file"]))  # traces written so, not damaged ones
    (tr / INDEX_FILE).write_text(json.dumps(index))
    prep_fails(["bake-onedecode", art, "--traces", tr, "--force"], "have no train rows", "larger --max-tokens",
               unchanged=(art,))


@pytest.mark.parametrize("flag, value", [("--width", 0), ("--max-steps", 0), ("--batch-size", 0), ("--clusters", 0),
                                         ("--lr", 0), ("--lr", -1), ("--lr", "nan")])
def test_train_router_option_ranges(art: Path, built_traces: Path, flag: str, value):
    prep_fails(["train-router", art, "--traces", built_traces, flag, value], f"Invalid value for '{flag}'", code=2,
               unchanged=(art,))


def test_gp_basis_rank_above_the_hidden_size(art: Path):
    prep_fails(["gp-basis", art, "--rank", 65], "--rank must be between 1 and the hidden size 64, got 65",
               unchanged=(art,))


# 8. Messages that name the right option and fix.

def test_gp_basis_max_tokens_zero(art: Path, built_traces: Path):
    prep_fails(["gp-basis", art, "--traces", built_traces, "--max-tokens", 0], "Invalid value for '--max-tokens'",
               code=2, unchanged=(art,))


def test_traces_shard_tokens_zero(tmp_path: Path, tiny_model: Path, corpus: Path):
    prep_fails(["traces", tiny_model, "--corpus", corpus, "-o", tmp_path / "t", "--shard-tokens", 0],
               "Invalid value for '--shard-tokens'", code=2)
    assert not (tmp_path / "t").exists()


def test_another_models_traces_name_the_command_that_makes_the_right_ones(art: Path, tmp_path: Path, other_model: Path,
                                                                          corpus: Path):
    other = tmp_path / "other-tr"
    prep_ok(["traces", other_model, "--corpus", corpus, "-o", other, "--max-tokens", 300])
    for args in (["train-router", art, "--traces", other, *ROUTER], ["gp-basis", art, "--traces", other],
                 ["bake-onedecode", art, "--traces", other]):
        prep_fails(args, "holds traces of other (vocabulary 256), not of tiny", "prep traces tiny -o NEW_DIR",
                   "--traces NEW_DIR", unchanged=(art,))


def test_prep_all_names_its_traces_option(art: Path, tr: Path, tiny_model: Path, corpus: Path, monkeypatch):
    from prep import recipes

    monkeypatch.setattr(recipes, "DEFAULTS", recipes.Recipe(
        cluster=recipes.ClusterRecipe(clusters=8, iterations=2), screen4=recipes.Screen4Recipe(in_all=False),
        router=recipes.RouterRecipe(corpus=str(corpus))))
    prep_fails(["all", tiny_model, "-o", art, "--with-router", "--traces", tr],
               "holds traces made with other settings (shard_tokens)", "or choose another --traces",
               unchanged=(art, tr))
    prep_fails(["all", tiny_model, "-o", art, "--with-router", "--traces", art], "is the artifact's own folder (-o)",
               code=2, unchanged=(art,))


# 9. Ctrl-C: a line that is true for each command.

def test_ctrl_c_in_traces_keeps_complete_shards(tmp_path: Path, tiny_model: Path, corpus: Path, monkeypatch):
    from prep import traces

    real = interrupt_at_shard(monkeypatch, 2)
    out = tmp_path / "tr"
    prep_fails(["traces", tiny_model, "--corpus", corpus, "-o", out, *TRACES],
               "interrupted; complete shards are kept: rerun the same command to resume", code=130)
    first = (out / "shard-00000.safetensors").read_bytes()
    monkeypatch.setattr(traces, "run_shard", real)
    prep_ok(["traces", tiny_model, "--corpus", corpus, "-o", out, *TRACES])
    assert (out / "shard-00000.safetensors").read_bytes() == first and len(shard_files(out)) == 5


def test_ctrl_c_in_import(tiny_model: Path, monkeypatch):
    from prep.cli import head_stages

    def interrupted(model):
        raise KeyboardInterrupt

    monkeypatch.setattr(head_stages, "resolve_model", interrupted)
    prep_fails(["import", tiny_model], "interrupted; nothing half-converted is kept in the model cache", code=130)


def test_ctrl_c_in_train_router(art: Path, built_traces: Path, tmp_path: Path, monkeypatch):
    import signal

    from prep.router_train import RouterModule

    def interrupted(self, batch, batch_idx):
        raise KeyboardInterrupt

    handler = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(RouterModule, "training_step", interrupted)
    prep_fails(["train-router", art, "--traces", built_traces, *ROUTER, "--work-dir", tmp_path / "work"],
               "interrupted; stages already written are kept", code=130, unchanged=(art,))
    assert signal.getsignal(signal.SIGINT) == handler  # Lightning had left it ignored
    assert Artifact.open(art).stages == ["clusters", "screen"]


# 10. Output: what the project controls is quiet and complete.

def test_train_router_output_is_quiet(art: Path, built_traces: Path, tmp_path: Path, capfd):
    out = prep_ok(["train-router", art, "--traces", built_traces, *ROUTER, "--work-dir", tmp_path / "work"])
    out += "".join(capfd.readouterr())  # Lightning logs to the stream it found at import, not click's
    for noise in ("Seed set", "Tip:", "GPU available", "/-2", "v_num"):
        assert noise not in out
    assert "router:" in out and "wrote stage router" in out and "(3 steps," in out


def test_gp_basis_reports_the_energy_of_a_small_rank(art: Path):
    assert "mean retained energy: weights qkv k=16: " in prep_ok(["gp-basis", art, "--rank", 16])


def test_two_devices_train_in_spawned_processes(art: Path, built_traces: Path, tmp_path: Path):
    out = prep_ok(["train-router", art, "--traces", built_traces, *ROUTER, "--devices", 2, "--work-dir", tmp_path / "w"])
    assert "(3 steps," in out and Artifact.open(art).stages == ["clusters", "router", "screen"]
    assert not (art / ".lock").exists()


def test_the_end_of_fit_closes_the_process_group_a_rank_opened():
    """Each spawned rank closes its gloo group itself, in step with the others (see ProcessGroupClosed)."""
    from prep.router_trainer import ProcessGroupClosed

    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        ProcessGroupClosed().teardown(None, None, "fit")
        assert not torch.distributed.is_initialized()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    ProcessGroupClosed().teardown(None, None, "fit")  # one device: no group, nothing to close


def test_prep_all_refuses_traces_in_the_artifacts_own_folder(tmp_path: Path, tiny_model: Path):
    out = tmp_path / "art"
    prep_fails(["all", tiny_model, "-o", out, "--with-router", "--traces", out], "is the artifact's own folder (-o)",
               "--traces traces/art", code=2)
    assert not out.exists()  # refused before any stage was built


@pytest.mark.parametrize("hidden", ["layers:0", "layers:x", "middle"])
def test_bad_router_hidden_before_any_work(art: Path, tmp_path: Path, hidden: str):
    """--hidden's form is checked before the model loads and k-means runs."""
    prep_fails(["train-router", art, "--traces", tmp_path, "--hidden", hidden], "--hidden must be 'final' or 'layers:N' with N >= 1",
               unchanged=(art,))


def test_an_interrupted_traces_folder_is_refused_by_its_readers(tmp_path: Path, tiny_model: Path, corpus: Path, art: Path,
                                                                 monkeypatch):
    """A folder whose run was stopped holds only some of its shards: every reader names it unfinished and the fix,
    and the rerun that finishes it makes it readable."""
    from prep import traces

    real = interrupt_at_shard(monkeypatch, 3)
    out = tmp_path / "tr"
    prep_fails(["traces", tiny_model, "--corpus", corpus, "-o", out, *TRACES], "interrupted", code=130)
    assert json.loads((out / INDEX_FILE).read_text())["finished"] is False
    for args in (["bake-onedecode", art, "--traces", out], ["gp-basis", art, "--traces", out],
                 ["train-router", art, "--traces", out, *ROUTER]):
        prep_fails(args, f"{out} holds unfinished traces (2 shards so far: its run stopped or is still going)",
                   "rerun the command that wrote them", unchanged=(art, out))
    monkeypatch.setattr(traces, "run_shard", real)
    prep_ok(["traces", tiny_model, "--corpus", corpus, "-o", out, *TRACES])
    assert json.loads((out / INDEX_FILE).read_text())["finished"] is True
    prep_ok(["gp-basis", art, "--traces", out])


def test_a_finished_flag_that_is_not_a_boolean_is_a_damaged_index(tr: Path, art: Path):
    index = json.loads((tr / INDEX_FILE).read_text())
    (tr / INDEX_FILE).write_text(json.dumps({**index, "finished": "yes"}))
    prep_fails(["gp-basis", art, "--traces", tr], f'{tr / INDEX_FILE} is not a traces index ("finished" is not true or false)',
               unchanged=(art, tr))


def test_traces_written_before_the_finished_flag_still_read(tr: Path, art: Path):
    index = json.loads((tr / INDEX_FILE).read_text())
    del index["finished"]
    (tr / INDEX_FILE).write_text(json.dumps(index))
    prep_ok(["gp-basis", art, "--traces", tr])
