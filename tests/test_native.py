"""The native backend on tiny random models: bit-identical to the lean backend on the dequantized weights.

Each tiny model is written to a GGUF the way llama.cpp's converter writes it (llama.cpp tensor names,
gemma norms stored as w + 1, llama q/k rows permuted), with its matrices quantized by gguf-py; the
reference model gets the weights transformers' own GGUF tensor processors make of the dequantized
blocks. The native forward must give torch.equal hidden states to the lean forward over that model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gguf import GGMLQuantizationType as T

from runtime.backends import BACKENDS, UnsupportedModel, choose_backend, native_unsupported
from runtime.backends.decoder import PREFILL_CHUNK
from runtime.backends.gguf_file import GGUFError, GGUFFile
from runtime.backends.lean import lean_target
from runtime.backends.native import native_target
from runtime.kernels import hugepages
from factories import needs_compiled_kernels

# HF parameter name inside a decoder layer -> llama.cpp tensor name.
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
GEMMA_NORMS = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}
OTHER_NORMS = {"post_attention_layernorm": "ffn_norm"}
MATRIX_TYPES = [T.Q8_0, T.Q5_0, T.Q4_1, T.Q4_0, T.Q5_1, T.F16, T.BF16]


def tiny_model(arch: str):
    """A tiny random model of `arch` (gemma3: sliding window, q/k norms, tied head; qwen2: q/k/v biases)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(7)
    if arch == "gemma3":
        config = Gemma3TextConfig(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=6,
                                  layer_types=["sliding_attention", "sliding_attention", "full_attention"], query_pre_attn_scalar=32)
        return Gemma3ForCausalLM(config).eval()
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2)).eval()
    return LlamaForCausalLM(LlamaConfig(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


def _llama_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (for its rotary layout)."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def write_gguf(model, path, arch: str) -> None:
    """Write `model` as llama.cpp would, then load into it what transformers makes of the written blocks."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    config = model.config
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    writer = gguf.GGUFWriter(str(path), arch)
    named = {"token_embd.weight": model.model.embed_tokens.weight, "output_norm.weight": model.model.norm.weight}
    if not config.tie_word_embeddings:
        named["output.weight"] = model.lm_head.weight
    norms = GEMMA_NORMS if arch == "gemma3" else OTHER_NORMS
    for i, layer in enumerate(model.model.layers):
        for hf, name in {**LAYER_NAMES, **norms}.items():
            if not _has(layer, hf):
                continue
            module = layer.get_submodule(hf)
            named[f"blk.{i}.{name}.weight"] = module.weight
            if getattr(module, "bias", None) is not None:
                named[f"blk.{i}.{name}.bias"] = module.bias
    for index, (name, param) in enumerate(named.items()):
        values = param.detach().float().numpy().copy()
        if arch == "gemma3" and "norm" in name:
            values = values + 1  # llama.cpp stores gemma's norm weights as 1 + w
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name) and name.endswith("weight"):
            heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
            values = _llama_permute(values, heads)
        qtype = MATRIX_TYPES[index % len(MATRIX_TYPES)] if values.ndim == 2 else T.F32
        blocks = gguf.quants.quantize(values, qtype) if qtype != T.F32 else values
        writer.add_tensor(name, blocks, raw_dtype=qtype)
        dequantized = gguf.quants.dequantize(blocks, qtype) if qtype != T.F32 else values
        with torch.no_grad():
            param.copy_(torch.from_numpy(np.ascontiguousarray(processor.process(dequantized, name).weights)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _has(layer, path: str) -> bool:
    try:
        layer.get_submodule(path)
        return True
    except AttributeError:
        return False


def hidden_in_chunks(target, tokens: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Feed tokens in chunks of the given sizes; all hidden states [T, d]."""
    cache, out, start = target.new_cache(), [], 0
    for size in sizes:
        out.append(target.forward(tokens[start : start + size], cache))
        start += size
    return torch.cat(out)


@pytest.fixture(params=["gemma3", "qwen2", "llama"])
def tiny_pair(request, tmp_path):
    """(lean target, native target) over the same tiny model and its GGUF."""
    arch = request.param
    model = tiny_model(arch)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(model, path, arch)
    return lean_target(model, set()), native_target(path, model.config, set())


def test_native_hidden_states_are_bit_identical_to_lean(tiny_pair) -> None:
    """Prefill (longer than a prefill chunk), single steps and verify-sized steps: torch.equal."""
    lean, native = tiny_pair
    tokens = torch.randint(0, 160, (PREFILL_CHUNK + 60,), generator=torch.Generator().manual_seed(0))
    sizes = [PREFILL_CHUNK + 20, 1, 4, 1, 16, 1, 8, 9]
    assert torch.equal(hidden_in_chunks(native, tokens, sizes), hidden_in_chunks(lean, tokens, sizes))
    short = [9, 1, 4, 1, 1, 8, 6]
    assert torch.equal(hidden_in_chunks(native, tokens, short), hidden_in_chunks(lean, tokens, short))


def test_a_long_prefill_shows_progress_and_a_short_one_does_not(tiny_pair, monkeypatch, capsys) -> None:
    from runtime.backends import decoder

    _, native = tiny_pair
    monkeypatch.setattr(decoder, "PREFILL_PROGRESS_TOKENS", PREFILL_CHUNK + 1)
    native.forward(torch.arange(PREFILL_CHUNK) % 160, native.new_cache())
    assert "prefill" not in capsys.readouterr().err
    native.forward(torch.arange(PREFILL_CHUNK + 1) % 160, native.new_cache())
    assert f"prefill:   0%|          | 0/{PREFILL_CHUNK + 1}" in capsys.readouterr().err


def test_tensor_directory_matches_gguf_py_past_string_arrays(tmp_path) -> None:
    """Skipping a vocabulary's string arrays (and other metadata) lands on gguf-py's tensor offsets;
    a file cut inside the string array is a one-line truncation error."""
    import gguf

    path = tmp_path / "v.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list([f"tok{i}" * (i % 7) for i in range(3000)])  # empty strings included
    writer.add_token_scores([float(i) for i in range(3000)])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_string("test.text", "héllo")
    blocks = gguf.quants.quantize(np.linspace(-1, 1, 64 * 32, dtype=np.float32).reshape(64, 32), T.Q8_0)
    writer.add_tensor("w", blocks, raw_dtype=T.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, reference = GGUFFile(path).tensors["w"], gguf.GGUFReader(path).get_tensor(0)
    assert (ours.offset, ours.nbytes, ours.ggml_type) == (reference.data_offset, reference.n_bytes, int(T.Q8_0))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:20000])  # inside the token list
    with pytest.raises(GGUFError, match="truncated .*assemble it again"):
        GGUFFile(cut)


def test_released_pages_read_back_the_same_bytes(tmp_path) -> None:
    """A tensor copied into a lanes layout gives its mapped pages back; a later read maps the same bytes."""
    model = tiny_model("qwen2")
    write_gguf(model, tmp_path / "q.gguf", "qwen2")
    file = GGUFFile(tmp_path / "q.gguf")
    name = next(n for n, info in file.tensors.items() if info.ggml_type == T.Q5_0)
    before = file.array(name).copy()
    file.release(name)
    assert np.array_equal(file.array(name), before)
    file.release(name, 5, 700)  # a slice, its first page rounded down to the page it starts on
    file.release(name, 700, 10**9)  # past the end: up to it
    assert np.array_equal(file.array(name), before)


@pytest.mark.skipif(not hugepages.enabled(), reason="this kernel gives no transparent huge pages")
def test_each_matrix_is_placed_in_huge_pages_once(tmp_path, arena_placements) -> None:
    """Every layer matrix, the table and the head are allocated in the arena once: a lanes repack and a
    llama q/k row reorder are written straight into it, not copied there afterwards."""
    model = tiny_model("llama")  # q/k rows permuted by llama.cpp, put back before the pack
    write_gguf(model, tmp_path / "l.gguf", "llama")
    native = native_target(tmp_path / "l.gguf", model.config, set())
    layers = native.decoder.layers
    matrices = [w for layer in layers for projection in (layer.qkv, layer.o, layer.gate_up, layer.down) for w in projection.parts]
    distinct = {w.data.data_ptr() for w in [*matrices, native.embedding, native.head_weight]}
    assert sorted(t.data_ptr() for t in arena_placements) == sorted(distinct)


@needs_compiled_kernels
def test_native_is_batch_invariant(tiny_pair) -> None:
    """A verify forward over n <= 16 tokens gives each position exactly its one-token value."""
    _, native = tiny_pair
    tokens = torch.randint(0, 160, (40,), generator=torch.Generator().manual_seed(1))
    ones = hidden_in_chunks(native, tokens, [24] + [1] * 16)
    batch = hidden_in_chunks(native, tokens, [24, 16])
    assert torch.equal(ones, batch)


def test_native_crop_rolls_back(tiny_pair) -> None:
    """After a crop, re-feeding other tokens gives what a fresh cache gives."""
    _, native = tiny_pair
    tokens = torch.randint(0, 160, (20,), generator=torch.Generator().manual_seed(5))
    cache = native.new_cache()
    native.forward(tokens[:12], cache)
    native.forward(tokens[12:18], cache)
    native.crop(cache, 12)
    again = native.forward(tokens[14:20], cache)
    fresh = hidden_in_chunks(native, torch.cat([tokens[:12], tokens[14:20]]), [12, 6])[12:]
    assert torch.equal(again, fresh)


def test_head_logits_match_lean(tiny_pair) -> None:
    """The native head (the GGUF's token_embd / output blocks) gives the lean head's logits bit for bit."""
    from runtime.kernels import linear

    lean, native = tiny_pair
    hidden = torch.randn(5, lean.hidden_size, generator=torch.Generator().manual_seed(2))
    assert torch.equal(linear(hidden, native.head_weight), linear(hidden, lean.head_weight))
    ids = torch.tensor([0, 7, 159])
    assert torch.equal(native.embedding_rows(ids), lean.embedding_rows(ids))


def test_auto_picks_native_for_a_readable_gguf(tmp_path) -> None:
    """auto: native for a GGUF it can read, lean for an HF directory; native refuses what it cannot read."""
    model = tiny_model("llama")
    path = tmp_path / "llama.gguf"
    write_gguf(model, path, "llama")
    assert "native" in BACKENDS and native_unsupported(path, model.config) is None
    assert choose_backend("auto", path, model.config) == "native"
    assert choose_backend("auto", None, model.config) == "lean"
    with pytest.raises(UnsupportedModel, match="--backend lean"):
        choose_backend("native", None, model.config)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(UnsupportedModel, match="truncated"):
        choose_backend("native", truncated, model.config)
