"""Plain greedy decoding on a hybrid recurrent target (qwen35), on device.

`specjax.generate` sends a qwen35 model here. What it does and refuses:

* Greedy decoding (temperature <= 0): a prefill of all rows (prompts right-padded; the
  padding leaves the recurrent state untouched), then one `lax.while_loop` of one-token steps.
  Rows stop at an end-of-generation token, at their max_new_tokens or a full context.
* Speculative decoding (greedy; n-gram drafters, draft-simple) runs in `specjax.hybrid_spec`: rejected
  draft tokens leave the recurrent state by n_rs_seq snapshot planes (`n_rs_seq > 0`, the RS
  path) or by restoring the pre-round state and replaying the accepted tokens (FULL), as
  llama.cpp's server; `n_rs_seq=None` takes upstream's `need_n_rs_seq`. A target the probe
  calls NO decodes without drafts, with a warning.
* Sampling (temperature > 0, top-k / top-p / min-p, per-row seeds) runs in the same
  `specjax.hybrid_spec` loop, with or without drafters: the token at position p is drawn
  with the key (seed, p, ROLE_SAMPLE), so speculative sampling gives plain sampling's tokens.
  Repeat penalties and custom KV cache types are refused with a ValueError.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import qwen35
from specjax.types import Array

_STOP, _LENGTH, _CONTEXT = "stop", "length", "context"


def _bucket(n: int) -> int:
    return max(8, 1 << (max(n, 1) - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("config", "capacity", "n_out"))
def _run(
    config: qwen35.Qwen35Config,
    params: Any,
    tokens_BT: Array,
    lengths_B: Array,
    max_new_B: Array,
    eog_ids: Array,
    capacity: int,
    n_out: int,
) -> tuple[Array, Array, Array]:
    """Prefill + greedy loop. Returns (out tokens [B, n_out], out_len [B], finish code [B])."""
    B, T = tokens_BT.shape
    positions_BT = jnp.where(jnp.arange(T)[None, :] < lengths_B[:, None], jnp.arange(T)[None], -1)
    state = qwen35.new_state(config, B, capacity)
    out = qwen35.forward(config, params, tokens_BT, positions_BT, state, cache_empty=True)
    last_BV = jnp.take_along_axis(out.logits, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
    first_B = jnp.argmax(last_BV, axis=-1).astype(jnp.int32)
    out_BN = jnp.zeros((B, n_out), jnp.int32).at[:, 0].set(first_B)

    def finished(tok_B: Array, n_B: Array, pos_B: Array) -> Array:
        """0 running, 1 EOG, 2 length, 3 context (pos_B: position of the emitted token; as
        llama.cpp and specjax.engine, the last token emitted sits at position capacity - 1)."""
        eog = jnp.any(tok_B[:, None] == eog_ids[None, :], axis=1)
        return jnp.where(
            eog, 1, jnp.where(n_B >= max_new_B, 2, jnp.where(pos_B >= capacity - 1, 3, 0))
        ).astype(jnp.int32)

    n_B = jnp.ones((B,), jnp.int32)
    fin_B = finished(first_B, n_B, lengths_B)

    def cond(carry: tuple[Any, ...]) -> Array:
        return jnp.any(carry[3] == 0)

    def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
        st, out_BN, n_B, fin_B, tok_B = carry
        running_B = fin_B == 0
        pos_B = jnp.where(running_B, lengths_B + n_B - 1, -1)
        o = qwen35.forward(config, params, tok_B[:, None], pos_B[:, None], st)
        nxt_B = jnp.argmax(o.logits[:, 0], axis=-1).astype(jnp.int32)
        idx_B = jnp.where(running_B, n_B, n_out)
        out_BN = out_BN.at[jnp.arange(B), idx_B].set(nxt_B, mode="drop")
        n_new_B = n_B + running_B.astype(jnp.int32)
        fin_new_B = jnp.where(running_B, finished(nxt_B, n_new_B, lengths_B + n_B), fin_B)
        tok_B = jnp.where(running_B, nxt_B, tok_B)
        return o.state, out_BN, n_new_B, fin_new_B, tok_B

    _, out_BN, n_B, fin_B, _ = jax.lax.while_loop(
        cond, body, (out.state, out_BN, n_B, fin_B, first_B)
    )
    return out_BN, n_B, fin_B


def generate_hybrid(
    model: Any,
    prompts: Any,
    *,
    max_new_tokens: int | Sequence[int],
    temperature: float = 0.0,
    repeat_penalty: float = 1.0,
    n_ctx: int | None = None,
    spec: Any = None,
    draft: Any = None,
    stop: Sequence[str] = (),
    n_rs_seq: int | None = None,
    slot_save_path: str | None = None,
    slot_save: Any = None,
    slot_restore: Any = None,
    slot_overwrite: bool = False,
    **_sampling: Any,
) -> Any:
    """`specjax.generate` for a qwen35 model (see the module docstring for what is refused)."""
    from specjax import api

    config = model.config
    speculative = spec is not None and spec.enabled
    if draft is not None and not speculative:
        raise ValueError("a draft model was given without a speculative type (spec)")
    if repeat_penalty != 1.0:
        raise ValueError(f"repeat_penalty {repeat_penalty} is not supported on {config.arch} yet")
    prompt_ids = api._tokenize_prompts(model, prompts)
    B = len(prompt_ids)
    max_new = api._n_predict(max_new_tokens, B)
    lengths = np.asarray([len(p) for p in prompt_ids], np.int32)
    n_ctx = int(n_ctx or config.max_position)
    if int(lengths.max()) >= n_ctx:
        raise ValueError(f"a prompt of {int(lengths.max())} tokens does not fit n_ctx={n_ctx}")
    max_new = np.where(max_new < 0, n_ctx, np.minimum(max_new, n_ctx)).astype(np.int32)
    T = _bucket(int(lengths.max()))
    n_out = _bucket(int(max_new.max()))
    tokens = np.zeros((B, T), np.int32)
    for b, p in enumerate(prompt_ids):
        tokens[b, : len(p)] = p
    eog = np.asarray(model.eog_ids or (-1,), np.int32)
    report = None
    sampling_params = None
    if np.any(
        np.asarray(temperature, dtype=np.float64) > 0
    ):  # sampled in specjax.hybrid_spec's loop (keys from seed and position)
        from specjax import sampling

        args = api._sampling_args(
            B, temperature, _sampling.get("top_k", 0), _sampling.get("top_p", 1.0),
            _sampling.get("min_p", 0.0), repeat_penalty,
        )  # fmt: skip
        seeds = api._per_row(_sampling.get("seed", 0), B, "seed")
        sampling_params = sampling.SamplingParams.create(
            batch=B,
            **{name: jnp.asarray(value) for name, value in args.items()},
            seed=jnp.asarray(seeds % (1 << 32), jnp.uint32),
        )
    slot_states, slot_report = None, None
    if slot_save_path is not None or slot_save is not None or slot_restore is not None:
        from specjax import slots

        slot_states, slot_report = slots.prepare(
            model, prompt_ids, directory=slot_save_path, save=slot_save, restore=slot_restore,
            overwrite=slot_overwrite, cache_type_k=None, cache_type_v=None,
        )  # fmt: skip
    from_slots = slot_states is not None and any(s is not None for s in slot_states)
    out_BN = None
    if speculative or from_slots or sampling_params is not None:
        from specjax.hybrid_spec import generate_speculative

        out_BN, out_len, fin, report, seconds = generate_speculative(
            model, prompt_ids, max_new, spec=spec if speculative else None, draft=draft,
            n_ctx=n_ctx, n_rs_seq=n_rs_seq, slots=slot_states, sampling_params=sampling_params,
        )  # fmt: skip
    if out_BN is None:
        t0 = time.perf_counter()
        out_BN, out_len, fin = jax.device_get(
            _run(
                config,
                model.params,
                jnp.asarray(tokens),
                jnp.asarray(lengths),
                jnp.asarray(max_new),
                jnp.asarray(eog),
                n_ctx,
                n_out,
            )
        )
        seconds = time.perf_counter() - t0
    results, texts, reasons = [], [], []
    for b in range(B):
        ids = [int(t) for t in out_BN[b, : out_len[b]]]
        reason = {1: _STOP, 2: _LENGTH, 3: _CONTEXT}.get(int(fin[b]), "none")
        if ids and reason == _STOP:
            ids = ids[:-1]
        text = model.decode(ids) if model.tokenizer is not None else ""
        if stop and text:
            ids, text, hit = api._apply_stop(model, ids, text, stop)
            reason = _STOP if hit else reason
        results.append(ids)
        texts.append(text)
        reasons.append(reason)
    generated = int(np.sum(out_len))
    timings: dict[str, Any] = {
        "prompt_tokens": int(lengths.sum()),
        "generated_tokens": generated,
        "total_seconds": seconds,  # compile included; no prefill/decode split yet
        "tokens_per_second": generated / max(seconds, 1e-9),
        # the keys the CLI prints: prefill and decode are one jitted call here (all in decode)
        "prefill_seconds": 0.0,
        "decode_seconds": seconds,
        "n_rounds": report.n_rounds if report is not None else max(int(np.max(out_len)) - 1, 0),
    }
    if slot_report:
        timings["slots"] = slot_report
    return dataclasses.replace(
        api.GenerationResult(
            tokens=results, text=texts, timings=timings, finish_reasons=reasons, stats=report
        ),
        prompt_tokens=prompt_ids,
    )
