"""Predicted vs engine-measured acceptance length of draft-simple. Prints JSON, writes a PNG.

    python benchmarks/acceptance.py [--drafts models/code-draft/code-draft-f16.gguf,...]
        [--temperatures 0,0.7,1.0] [--modes greedy,probabilistic] [--rows 8] [--tokens 128]
        [--n-max 4] [--seeds 0] [--out benchmarks/results/acceptance.json]

For each draft model, temperature and drafting mode the engine generates `--tokens` tokens for
`--rows` prompts (the first 400 characters of held-out validation files, `specjax.train.data`'s split)
with draft-simple, n_max = `--n-max`, the governor off (every round drafts its full budget)
and sampling by temperature alone (top-k/top-p/min-p off). Its statistics give the measured
mean acceptance length (1 + accepted / drafts). Then both models read the generated path
(teacher forcing) and `specjax.train.objectives` predicts it:

* alpha_j per generated token: p_T(argmax q) for greedy drafting (the default mode, verified by
  match), sum_x min(p_T, q_T) with draft-simple's top-10 q for probabilistic drafting;
* `objectives.path_acceptance_length(alpha, n_max)`: the expected mean acceptance length of the
  engine's rounds along that path, draft budgets at the end included.

With greedy drafting the engine's tokens are plain sampling's, and a drafted token is accepted
iff it equals the path's token: `replayed` (the same recursion on the 0/1 indicators
1[g_j == argmax q]) must equal the measurement exactly; it checks the benchmark's model of the
engine, and `predicted` differs from it only by the sampling noise of the indicators around
their probabilities. For probabilistic drafting alpha is evaluated on the target's path (the
accepted tokens' distribution is min(p, q) / alpha, not p): an approximation.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_DRAFT, DEFAULT_TARGET, machine, refuse_overwrite

import specjax
from specjax.config import SpecConfig
from specjax.train import objectives as obj
from specjax.train.target import model_logits


def validation_prompts(n: int, chars: int = 400) -> list[str]:
    from specjax.train.data import read_texts, split_files, stdlib_files

    _, val = split_files(stdlib_files())
    texts = [t for t in read_texts(val) if len(t) > 2 * chars]
    return [t[:chars] for t in texts[:n]]


def _teacher_forced(model: specjax.Model, seqs: list[list[int]], length: int) -> jax.Array:
    """Logits [R, length, V] of each sequence padded at the end to `length` (causal)."""
    batch = np.zeros((len(seqs), length), np.int32)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
    fn = jax.jit(model_logits, static_argnums=0)
    return fn(model.config, model.params, jnp.asarray(batch))


def path_alphas(
    target: specjax.Model,
    draft: specjax.Model,
    prompts: list[list[int]],
    generated: list[list[int]],
    temperature: float,
    mode: str,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per row: alpha_j and the greedy-draft indicator 1[g_j == argmax q] per generated token."""
    seqs = [p + g for p, g in zip(prompts, generated)]
    length = -(-max(len(s) for s in seqs) // 64) * 64
    t_logits = _teacher_forced(target, seqs, length)
    d_logits = _teacher_forced(draft, seqs, length)
    tparams = obj.sampling_params(temperature=temperature)
    if mode == "greedy":
        alpha = obj.greedy_acceptance_rate(t_logits, d_logits, tparams)
    else:
        alpha = obj.acceptance_rate(t_logits, d_logits, tparams, obj.draft_params(temperature))
    alpha_np = np.asarray(alpha)
    argmax_q = np.asarray(jnp.argmax(d_logits, -1))
    alphas, hits = [], []
    for r, (p, g) in enumerate(zip(prompts, generated)):
        idx = np.arange(len(p) - 1, len(p) - 1 + len(g))
        alphas.append(alpha_np[r, idx].astype(np.float64))
        hits.append((argmax_q[r, idx] == np.asarray(g)).astype(np.float64))
    return alphas, hits


def measure(
    target: specjax.Model,
    draft: specjax.Model,
    prompts: list[str],
    temperature: float,
    mode: str,
    tokens: int,
    n_max: int,
    seed: int,
) -> dict[str, Any]:
    spec = SpecConfig(
        types=("draft-simple",), draft_n_max=n_max, adaptive=False, draft_sampling=mode
    )
    out = specjax.generate(
        target,
        prompts,
        max_new_tokens=tokens,
        spec=spec,
        draft=draft,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        seed=seed,
    )
    stats = out.stats.to_dict()
    alphas, hits = path_alphas(target, draft, out.prompt_tokens, out.tokens, temperature, mode)
    acc, rounds = obj.path_acceptance_length(alphas, n_max, total=True)
    return {
        "measured": stats["mean_acceptance_length"],
        "num_drafts": stats["num_drafts"],
        "num_accepted_tokens": stats["num_accepted_tokens"],
        "predicted": 1.0 + acc / rounds if rounds else 1.0,
        "predicted_drafts": rounds,
        "replayed": obj.path_acceptance_length(hits, n_max),
        "mean_alpha": float(np.mean(np.concatenate([a[1:] for a in alphas]))),
        "generated_tokens": sum(len(g) for g in out.tokens),
    }


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    colors = {0.0: "tab:blue", 0.7: "tab:orange", 1.0: "tab:red"}
    markers = {"greedy": "o", "probabilistic": "s"}
    lo = min(min(r["measured"], r["predicted"]) for r in results) - 0.1
    hi = max(max(r["measured"], r["predicted"]) for r in results) + 0.1
    xs = np.linspace(lo, hi, 2)
    ax.plot(xs, xs, "k-", lw=0.8)
    ax.fill_between(xs, xs * 0.95, xs * 1.05, color="0.9", label="±5%")
    seen = set()
    for r in results:
        key = (r["temperature"], r["mode"])
        ax.scatter(
            r["measured"],
            r["predicted"],
            color=colors.get(r["temperature"], "tab:gray"),
            marker=markers.get(r["mode"], "x"),
            label=None if key in seen else f"T={r['temperature']:g} {r['mode']}",
            s=28,
        )
        seen.add(key)
    ax.set_xlabel("measured mean acceptance length (engine)")
    ax.set_ylabel("predicted (specjax.train.objectives along the path)")
    ax.set_title("draft-simple: predicted vs measured")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=str(DEFAULT_TARGET))
    ap.add_argument("--drafts", default=str(DEFAULT_DRAFT), help="comma list of draft GGUFs")
    ap.add_argument("--names", default="", help="comma list of names for --drafts")
    ap.add_argument("--temperatures", default="0,0.7,1.0")
    ap.add_argument("--modes", default="greedy,probabilistic")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--n-max", type=int, default=4)
    ap.add_argument("--seeds", default="0", help="comma list; results are averaged over seeds")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "acceptance.json"))
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = ap.parse_args()
    refuse_overwrite(args.out, args.overwrite)

    target = specjax.load(args.model)
    paths = args.drafts.split(",")
    names = args.names.split(",") if args.names else [Path(p).parent.name for p in paths]
    prompts = validation_prompts(args.rows)
    seeds = [int(s) for s in args.seeds.split(",")]
    results: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for name, path in zip(names, paths):
        draft = specjax.load(path)
        for mode in args.modes.split(","):
            for temp in (float(t) for t in args.temperatures.split(",")):
                runs = [
                    measure(target, draft, prompts, temp, mode, args.tokens, args.n_max, s)
                    for s in seeds
                ]
                r: dict[str, Any] = {"draft": name, "path": path, "mode": mode, "temperature": temp}
                for key in runs[0]:
                    r[key] = float(np.mean([run[key] for run in runs]))
                r["per_seed_measured"] = [run["measured"] for run in runs]
                r["error"] = r["predicted"] / r["measured"] - 1.0
                results.append(r)
                print(
                    f"{name:14s} {mode:13s} T={temp:<4g} measured {r['measured']:.3f} "
                    f"predicted {r['predicted']:.3f} ({100 * r['error']:+.1f}%) "
                    f"replayed {r['replayed']:.3f}",
                    file=sys.stderr,
                    flush=True,
                )
    report = {
        "machine": machine(),
        "settings": {
            "rows": args.rows,
            "tokens": args.tokens,
            "n_max": args.n_max,
            "seeds": seeds,
            "governor": "off",
            "sampling": "temperature only (top-k/top-p/min-p off)",
        },
        "seconds": round(time.perf_counter() - t0, 1),
        "max_abs_error": max(abs(r["error"]) for r in results),
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    plot(results, out.with_suffix(".png"))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
