"""Benchmark: scored (template, example) pairs per second, the naive way against the project's scorer.

Both score the same candidate templates on the same dev examples of the `risk` task with the same model (bf16
where the CPU has it, float32 otherwise), alternating template by template so that a change in machine load hits
both, for --rounds rounds; each template's fastest time per method counts (the machine is shared; see main()):
  * naive:   one unbatched forward pass per pair over the whole prompt, logits at every position
             (`pipelines.engine.target.score_naive`);
  * scorer:  `pipelines.engine.target.LabelScorer` with an empty pair cache: the template's shared prompt prefix
             once per thread, at the head of its first batch (started from an earlier template's rows where
             the tokens agree: the chat header), the example suffixes packed without padding through
             `pipelines.engine.packed_llama`, the last layer and the label rows of the output layer at each
             example's last position only, the examples dealt to one thread per core by token count;
  * cached:  the same scorer asked again for the same pairs (a template seen again during tuning);
  * llama.cpp (a column only when ``llama_cpp`` imports, e.g. ``pip install llama-cpp-python``): the same GGUF
             file the embedded model is made from (Q4_1, not de-quantized), one pair at a time, reusing the key/value
             cache of the tokens it shares with the previous prompt, the next-token logits at the last position;
             what a CPU user would reach for.
Both use the same number of cores (--threads): the naive way through torch's intra-op threads, the scorer
through its own threads of one intra-op thread each.
It prints pairs/s and the ratios, and the model FLOP/s each achieves against the matrix-multiply
FLOP/s (same dtype) measured on this machine in the same run.

Then the greedy answers (what ``instruction_following`` and an answer decision read), in the same run:
  * generate: `model.generate` per pair, greedy, the whole prompt, as many new tokens as the scorer's answer
              to that pair took (so both do the same decoding work), one pair at a time;
  * answers:  `LabelScorer.answer` with an empty cache: the packed scoring pass (shared prefix once, which also
              gives the label log-probs) gives the first token, the rest are decoded over that pass's kept keys
              and values, a batch's running answers one pass per token (``PackedLlama.greedy``), stopping at the
              contract's first word (risk's `first_word` rule).
The script counts the pairs whose text differs (in float32 none should; in bfloat16 the two paths round
differently and a nearly tied token can go the other way).

Every row gives pairs/s and prompt tokens/s (the tokens of the rendered prompts, chat template included,
whatever a method actually runs). ``--input-chars 1000`` makes each input about 1,000 characters long
(consecutive dev messages joined with a space, then cut), the long-input case of the cost model.

    .venv/bin/python -m bench.scoring [--examples 60] [--templates 6] [--threads 2] [--rounds 2]
    .venv/bin/python -m bench.scoring --input-chars 1000 --examples 20 --templates 3
    .venv/bin/python -m bench.scoring --long-too      # and then the 1,000-character case, in the same run
    .venv/bin/python -m bench.scoring --answers-only [--examples 60] [--templates 6]
"""

from __future__ import annotations

import argparse
import sys
import time

from pipelines.cli import quiet_libraries
from pipelines.cli_output import table

INSTRUCTIONS = [
    None,  # the seed
    "You are a fraud analyst at a bank. Messages that offer prizes, ask for urgent payment, give premium-rate "
    "numbers or ask you to text a code to claim something are scams.",
    "Decide whether this SMS is a scam.",
    "Read the message carefully. Scam messages often promise free gifts, cash or holidays, use urgent language, "
    "and ask the reader to call or text a number.",
    "Check the sender's tone, any links or phone numbers, and whether money or personal details are requested.",
    "Classify the text message.",
]


def matmul_flops(threads: int, dtype_name: str = "bfloat16", n: int = 2048, repeats: int = 10,
                 trials: int = 3) -> float:
    """The machine's matrix-multiply FLOP/s: the best of ``trials`` timings (a busy moment would understate it)."""
    import torch

    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(trials):
        started = time.perf_counter()
        for _ in range(repeats):
            a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * n**3 * repeats / best


def long_inputs(messages: list[str], n: int, chars: int) -> list[str]:
    """``n`` inputs of ``chars`` characters: consecutive messages joined with a space, cut at ``chars``."""
    out, i = [], 0
    while len(out) < n:
        parts, size = [], 0
        while size < chars:
            parts.append(messages[i % len(messages)])
            size += len(parts[-1]) + 1
            i += 1
        out.append(" ".join(parts)[:chars])
    return out


def llama_cpp_model(threads: int):
    """The embedded model's own GGUF file in llama.cpp, or None when ``llama_cpp`` is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    from pipelines.engine.models import _GGUF_FILE, _GGUF_PACKAGE, _package_dir

    return Llama(model_path=str(_package_dir(_GGUF_PACKAGE) / _GGUF_FILE), n_ctx=2048, n_threads=threads,
                 n_threads_batch=threads, n_batch=512, logits_all=False, verbose=False)


def score_llama_cpp(llm, prompts: list[list[int]], label_ids):
    """Label log-probs from llama.cpp, one prompt at a time: the key/value cache keeps the tokens the prompt
    shares with the one before it (the template's prefix), only the rest is evaluated."""
    import numpy as np
    import torch

    from pipelines.engine.target import label_logprobs

    rows, previous = [], []
    for ids in prompts:
        keep = 0
        while keep < min(len(ids), len(previous)) - 1 and ids[keep] == previous[keep]:
            keep += 1
        llm.n_tokens = keep  # llama.cpp drops the cache past n_tokens on the next eval
        llm.eval(ids[keep:])
        rows.append(label_logprobs(torch.from_numpy(np.array(llm.scores[llm.n_tokens - 1])), label_ids))
        previous = ids
    return np.stack(rows)


def main() -> int:
    quiet_libraries()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=60)
    parser.add_argument("--templates", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="examples per forward pass of the scorer")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds; each template's fastest counts")
    parser.add_argument("--answers-only", action="store_true", help="only the greedy answers against model.generate")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"],
                        help="the model's dtype (default: the project's, bfloat16 where the CPU computes it natively)")
    parser.add_argument("--input-chars", type=int, default=0,
                        help="make each input this many characters long (dev messages joined); 0: the messages as they are")
    parser.add_argument("--long-too", action="store_true",
                        help="after the run above, the same for 1,000-character inputs (20 examples, 3 templates)")
    args = parser.parse_args()

    import torch

    from pipelines.config import load_task
    from pipelines.engine.models import load_causal_lm

    torch.set_num_threads(args.threads)
    task = load_task("risk")
    lm = load_causal_lm(dtype=args.dtype) if args.dtype else load_causal_lm()
    llm = None if args.answers_only else llama_cpp_model(args.threads)
    if llm is None and not args.answers_only:
        print("llama.cpp: not installed (pip install llama-cpp-python for its column)\n")
    shapes = [(args.input_chars, args.examples, args.templates)]
    if args.long_too:
        shapes.append((1000, 20, min(3, args.templates)))
    for chars, examples, n_templates in shapes:
        bench_shape(task, lm, llm, args, chars, examples, n_templates)
    return 0


def bench_shape(task, lm, llm, args, chars: int, examples: int, n_templates: int) -> None:
    """Scoring (and then answers) for one input shape: ``chars`` characters an input (0: the messages)."""
    import numpy as np

    from pipelines.data import load_splits
    from pipelines.engine.target import LabelScorer, label_token_ids, prompt_frame, score_naive

    dev = [e.text for e in load_splits(task).dev]
    texts = long_inputs(dev, examples, chars) if chars else dev[:examples]
    templates = [task.seed_template() if i is None else task.make_template(task.compose(i))
                 for i in INSTRUCTIONS[:n_templates]]
    verbalizers = [task.labels[n].verbalizer for n in task.labels]
    config = lm.model.config
    d, vocab, layers = config.hidden_size, config.vocab_size, config.num_hidden_layers
    embed = lm.model.get_input_embeddings().weight.numel()
    body = sum(p.numel() for p in lm.model.parameters()) - embed  # tied output layer counted once, in embed

    def flops(tokens: int, context: float, head_rows: int, head_positions: int,
              last_layer_tokens: int | None = None) -> float:
        # 2 FLOPs per weight per token, attention scores and mixing (4*d*context per layer), the output layer;
        # last_layer_tokens: the last layer runs only its key/value projections for the other tokens
        total = 2 * body * tokens + 4 * layers * d * context * tokens + 2 * d * head_rows * head_positions
        if last_layer_tokens is not None:
            per_layer = 2 * body / layers
            kv_share = 2 * config.num_key_value_heads * (d // config.num_attention_heads) * d * 2
            total -= (tokens - last_layer_tokens) * (per_layer - kv_share + 4 * d * context)
        return total

    if args.answers_only:
        bench_answers(lm, task, templates, texts, args)
        return
    scorer = LabelScorer(lm, verbalizers, batch_size=args.batch_size)
    label_ids = label_token_ids(lm.tokenizer, verbalizers)
    # Per template and method, the fastest of --rounds rounds: this machine is shared, and a busy neighbour
    # slows the naive way (two threads in lockstep on every operation) more than the scorer's independent
    # threads, which would flatter the ratio. Every round starts from an empty scorer (no pairs, no prefixes).
    naive_t = np.full((args.rounds, len(templates)), np.inf)
    fast_t = np.full((args.rounds, len(templates)), np.inf)
    llama_t = np.full((args.rounds, len(templates)), np.inf)
    cached_s = 0.0
    naive_flops = fast_flops = 0.0
    prompt_tokens = 0
    max_diff = llama_diff = 0.0
    score_naive(lm, templates[0], texts[:2], verbalizers)  # warm-up
    for r in range(args.rounds):
        scorer.clear_cache()
        for j, template in enumerate(templates):
            started = time.perf_counter()
            naive = score_naive(lm, template, texts, verbalizers)
            naive_t[r, j] = time.perf_counter() - started

            tokens_before = scorer.stats.tokens_forward
            started = time.perf_counter()
            fast = scorer.score(template, texts)
            fast_t[r, j] = time.perf_counter() - started
            before, after = prompt_frame(lm.tokenizer, template, True)
            prompts = [lm.tokenizer(before + t + after, add_special_tokens=False).input_ids for t in texts]
            if r == 0:
                lengths = [len(ids) for ids in prompts]
                naive_flops += sum(flops(n, n / 2, vocab, n) for n in lengths)
                prompt_tokens += sum(lengths)
                tokens = scorer.stats.tokens_forward - tokens_before
                fast_flops += flops(tokens, float(np.mean(lengths)) / 2, 12, len(texts), last_layer_tokens=len(texts))
                started = time.perf_counter()
                again = scorer.score(template, texts)
                cached_s += time.perf_counter() - started
                assert np.array_equal(again, fast)
            if llm is not None:
                started = time.perf_counter()
                theirs = score_llama_cpp(llm, prompts, label_ids)
                llama_t[r, j] = time.perf_counter() - started
                llama_diff = max(llama_diff, float(np.abs((theirs[:, 0] - theirs[:, 1]) - (naive[:, 0] - naive[:, 1])).max()))
            max_diff = max(max_diff, float(np.abs((fast[:, 0] - fast[:, 1]) - (naive[:, 0] - naive[:, 1])).max()))
        if r == 0:
            tokens_run, prefix_reused = scorer.stats.tokens_forward, scorer.stats.prefix_tokens_reused
    naive_s, fast_s = float(naive_t.min(0).sum()), float(fast_t.min(0).sum())
    round_ratios = naive_t.sum(1) / fast_t.sum(1)

    pairs = len(templates) * len(texts)
    dtype = str(next(lm.model.parameters()).dtype).removeprefix("torch.")  # float32 where the CPU lacks bf16
    peak = matmul_flops(args.threads, dtype)
    rows = [
        {"method": "naive (1 forward/pair)", "pairs": pairs, "seconds": naive_s, "pairs_per_s": pairs / naive_s,
         "tokens_per_s": prompt_tokens / naive_s, "ratio": 1.0, "model_GFLOP_per_s": naive_flops / naive_s / 1e9,
         "of_matmul_peak": naive_flops / naive_s / peak},
        {"method": "project scorer", "pairs": pairs, "seconds": fast_s, "pairs_per_s": pairs / fast_s,
         "tokens_per_s": prompt_tokens / fast_s, "ratio": naive_s / fast_s,
         "model_GFLOP_per_s": fast_flops / fast_s / 1e9, "of_matmul_peak": fast_flops / fast_s / peak},
        {"method": "project scorer, cached", "pairs": pairs, "seconds": cached_s, "pairs_per_s": pairs / cached_s,
         "tokens_per_s": prompt_tokens / cached_s, "ratio": naive_s / cached_s, "model_GFLOP_per_s": "",
         "of_matmul_peak": ""},
    ]
    if llm is not None:
        llama_s = float(llama_t.min(0).sum())
        rows.append({"method": "llama.cpp (Q4_1 GGUF, prefix cache)", "pairs": pairs, "seconds": llama_s,
                     "pairs_per_s": pairs / llama_s, "tokens_per_s": prompt_tokens / llama_s, "ratio": naive_s / llama_s,
                     "model_GFLOP_per_s": "", "of_matmul_peak": ""})
    shape = f"inputs of {chars} characters" if chars else "the messages as they are"
    print(f"risk dev split: {len(templates)} templates x {len(texts)} examples ({shape}; "
          f"{prompt_tokens / pairs:.0f} prompt tokens a pair), {dtype}, "
          f"{args.threads} threads, batch {args.batch_size}; seconds: each template's fastest of {args.rounds} rounds")
    print(table(rows))
    print(f"\nwork per pair: naive {naive_flops / pairs / 1e9:.1f} GFLOP, scorer {fast_flops / pairs / 1e9:.1f} GFLOP "
          f"(ratio {naive_flops / fast_flops:.2f})")
    print(f"{dtype} matmul 2048x2048 on this machine: {peak / 1e9:.0f} GFLOP/s (the hardware figure to compare with)")
    print(f"tokens run by the scorer in a round: {tokens_run} ({prefix_reused} prefix tokens taken from earlier "
          f"templates' rows instead)")
    print(f"largest |log-odds difference| scorer vs naive: {max_diff:.3f} ({dtype}; see tests/test_scoring.py)")
    if llm is not None:
        print(f"largest |log-odds difference| llama.cpp (Q4_1) vs naive ({dtype}, de-quantized): {llama_diff:.3f}")
    print(f"ratio of each round on its own: {', '.join(f'{x:.2f}' for x in round_ratios)}")
    print(f"target: scorer/naive >= 5 (aim 10); measured {naive_s / fast_s:.2f}")
    bench_answers(lm, task, templates, texts, args)
    print()


def bench_answers(lm, task, templates, texts, args) -> None:
    """Greedy answers per second: ``LabelScorer.answer`` against ``model.generate`` per pair, same tokens."""
    import torch

    from pipelines.engine.target import LabelScorer, prompt_frame
    from pipelines.scoring import task_contract

    contract = task_contract(task)
    scorer = LabelScorer(lm, task.verbalizers, batch_size=args.batch_size)
    max_new = task.scoring.answer.max_new_tokens
    answers_s = generate_s = 0.0
    mismatches = tokens = prompt_tokens = 0
    for template in templates:
        scorer.clear_cache()
        started = time.perf_counter()
        answers = scorer.answer(template, texts, max_new, contract.complete)
        answers_s += time.perf_counter() - started
        before, after = prompt_frame(lm.tokenizer, template, True)
        for text, answer in zip(texts, answers):
            ids = lm.tokenizer(before + text + after, return_tensors="pt", add_special_tokens=False).input_ids
            prompt_tokens += ids.shape[1]
            started = time.perf_counter()
            with torch.inference_mode():
                out = lm.model.generate(ids, max_new_tokens=max(1, answer.tokens), do_sample=False)
            generate_s += time.perf_counter() - started
            reference = lm.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            mismatches += reference != answer.text
            tokens += answer.tokens
    pairs = len(templates) * len(texts)
    rows = [
        {"method": "model.generate per pair", "pairs": pairs, "seconds": generate_s, "pairs_per_s": pairs / generate_s,
         "tokens_per_s": (prompt_tokens + tokens) / generate_s, "ratio": 1.0},
        {"method": "LabelScorer.answer", "pairs": pairs, "seconds": answers_s, "pairs_per_s": pairs / answers_s,
         "tokens_per_s": (prompt_tokens + tokens) / answers_s, "ratio": generate_s / answers_s},
    ]
    print(f"\ngreedy answers (contract: {contract.describe()}; at most {max_new} new tokens, {tokens / pairs:.2f} "
          f"on average; one round; tokens_per_s counts prompt and answer tokens)")
    print(table(rows))
    print(f"answers that differ from model.generate's: {mismatches} of {pairs}")


if __name__ == "__main__":
    sys.exit(main())
