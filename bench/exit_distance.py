"""What the skip exit policy costs against the reference semantics, on a text (docs/ABI.md
"Adaptive exit").

    python3 bench/exit_distance.py MODEL TEXT --exit RULE [--loops L] [--prompt-len P]
        [--tokens N] [--start C] [--device cpu] [--repeats R] [--byte-ids] [--json]

Scores the first N tokens of TEXT (from character C on, tokenized by the model's tokenizer, or
its UTF-8 bytes as ids with --byte-ids) twice with the same exit rule and prompt length, under
``exit_policy="reference"`` and ``"skip"`` (``Model.score_exit``: the first P tokens run as a
generation's prompt, each later one as a generated token, its own step at the policy). Both
policies compute the prompt alike, so the figures are over the rows run as generated tokens
(P to N - 1):

* mean exit iteration under each policy;
* argmax agreement: the share of those rows whose most likely next token is the same;
* KL(reference || skip) in nats of each row's next-token distribution: mean and max;
* max |logit difference| relative to the row's max |logit| under the reference, worst row;
* the mean negative log-likelihood of the text's next token (nats/token; rows P to N - 2) under
  each policy, and under a plain score at the same loops (no exit), for scale;
* the wall time of each scoring call with an exit (the median of R calls).

NumPy computes the distances in float64 from the float32 logits. Needs NumPy and tinyloop_py
(installed, or ``PYTHONPATH=bindings/python`` with the library in ``target/release``).
docs/QUALITY.md "Adaptive exit" has figures of the demo model.
"""

import argparse
import json
import statistics
import time

import numpy as np
import tinyloop_py as tl


def log_softmax(logits):
    x = logits.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def timed(call, repeats):
    """The result of the last call and the median wall time of ``repeats`` calls, in ms."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = call()
        times.append((time.perf_counter() - start) * 1e3)
    return result, statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("text", help="a UTF-8 text file")
    ap.add_argument("--exit", required=True, help='an exit rule: "gate:0.5", "kl:0.01", ...')
    ap.add_argument("--loops", type=int, default=None, help="default: the model's")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--start", type=int, default=0, help="first character of TEXT used")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--byte-ids", action="store_true", help="the text's UTF-8 bytes as token ids "
                    "(a model without a tokenizer, such as a synthetic checkpoint of a public shape)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()

    with open(args.text, encoding="utf-8") as f:
        text = f.read()[args.start :]
    model = tl.Model(args.model, max_seq_len=args.tokens, device=args.device, log=False)
    if args.byte_ids:
        tokens = np.frombuffer(text.encode("utf-8")[: args.tokens], dtype=np.uint8).astype(np.int32)
    else:
        # Tokens other than special ones span at least one character: 4N characters hold N tokens.
        tokens = model.tokenize(text[: args.tokens * 4])[: args.tokens]
    if len(tokens) < args.tokens:
        ap.error(f"{args.text} holds {len(tokens)} tokens from character {args.start} on")
    p = args.prompt_len
    if not 1 <= p < len(tokens) - 1:
        ap.error(f"--prompt-len must be in 1..{len(tokens) - 2}")

    scored = {}
    for policy in ("reference", "skip"):
        (logits, steps), ms = timed(
            lambda: model.score_exit(
                tokens, args.loops, exit=args.exit, exit_policy=policy, prompt_len=p
            ),
            args.repeats,
        )
        scored[policy] = (logits[p:], steps[p:], ms)
    (ref, ref_steps, ref_ms), (skip, skip_steps, skip_ms) = scored["reference"], scored["skip"]

    plain = log_softmax(model.score(tokens, args.loops)[p:])
    lp_ref, lp_skip = log_softmax(ref), log_softmax(skip)
    kl = (np.exp(lp_ref) * (lp_ref - lp_skip)).sum(axis=1)
    relative = np.abs(ref - skip).max(axis=1) / np.abs(ref).max(axis=1)
    following = tokens[p + 1 :]
    rows = np.arange(len(following))
    report = {
        "model": args.model,
        "text": args.text,
        "start": args.start,
        "tokens": len(tokens),
        "prompt_len": p,
        "rows": len(ref),
        "exit": args.exit,
        "loops": args.loops or model.config()["default_loops"],
        "device": model.device,
        "mean_exit_steps": {"reference": float(ref_steps.mean()), "skip": float(skip_steps.mean())},
        "argmax_agreement": float((ref.argmax(axis=1) == skip.argmax(axis=1)).mean()),
        "kl_mean_nats": float(kl.mean()),
        "kl_max_nats": float(kl.max()),
        "max_rel_logit_diff": float(relative.max()),
        "nll_nats_per_token": {
            "reference": float(-lp_ref[rows, following].mean()),
            "skip": float(-lp_skip[rows, following].mean()),
            "plain": float(-plain[rows, following].mean()),
        },
        "score_ms": {"reference": ref_ms, "skip": skip_ms},
    }
    if args.json:
        print(json.dumps(report))
        return
    steps, nll, ms = report["mean_exit_steps"], report["nll_nats_per_token"], report["score_ms"]
    print(
        f"{report['tokens']} tokens, prompt {p}, {report['rows']} rows scored as generated; "
        f"exit {args.exit}, loops {report['loops']}, {report['device']}\n"
        f"mean exit iteration: reference {steps['reference']:.3f}, skip {steps['skip']:.3f}\n"
        f"argmax agreement {report['argmax_agreement']:.4f}\n"
        f"KL(reference || skip): mean {report['kl_mean_nats']:.3e}, "
        f"max {report['kl_max_nats']:.3e} nats\n"
        f"max |logit difference| / max |logit| of its row: {report['max_rel_logit_diff']:.3e}\n"
        f"NLL of the text: reference {nll['reference']:.4f}, skip {nll['skip']:.4f}, "
        f"no exit {nll['plain']:.4f} nats/token\n"
        f"score_exit: reference {ms['reference']:.1f} ms, skip {ms['skip']:.1f} ms"
    )


if __name__ == "__main__":
    main()
