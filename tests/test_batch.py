"""`specjax.batch`: request validation, continuous batching, resume, no recompiles.

The independent source for tokens is `specjax.generate` (one static batch, whole-prompt
prefill, its own loop): a job's records must hold, for every request, exactly the tokens
`generate` gives that prompt with the request's sampling values, whatever the job's
`n_parallel`, speculation, or interruptions.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

import specjax
from specjax.config import SpecConfig
from specjax.jobs import batch as batching
from specjax.testing import count_compiles, noisy_copy, tiny_model_with_tokenizer

N_CTX, CHUNK = 128, 16


@pytest.fixture(scope="module")
def model():
    return tiny_model_with_tokenizer(0)


@pytest.fixture(scope="module")
def spec():
    return SpecConfig(
        types=("ngram-mod", "draft-simple"),
        ngram_mod_n_match=4,
        ngram_mod_n_min=2,
        ngram_mod_n_max=8,
        ngram_mod_pool_size=1 << 12,
        draft_n_max=4,
        adaptive=False,  # draft every round (the governor may turn a tiny model's drafts off)
    )


@pytest.fixture(scope="module")
def draft(model):
    return noisy_copy(model, 0.3)


def make_requests(model, n: int, seed: int) -> list[dict]:
    """Mixed prompt lengths (1..40 tokens, across prefill chunks), outputs (1..24), greedy
    and temperature 0.8 rows, some repetitive prompts (n-gram drafts get accepted)."""
    rng = np.random.default_rng(seed)
    V = model.config.V
    out = []
    for i in range(n):
        L = int(rng.integers(1, 41))
        if i % 3 == 0:
            unit = [int(x) for x in rng.integers(3, V, 5)]
            toks = (unit * 10)[:L]
        else:
            toks = [int(x) for x in rng.integers(3, V, L)]
        req = {"tokens": toks, "n_predict": int(rng.integers(1, 25)), "seed": 100 + i}
        if i % 2:
            req["temperature"] = 0.8
        out.append(req)
    return out


def reference(model, reqs: list[dict]) -> dict[int, list[int]]:
    """Tokens per request id (line number) from `specjax.generate`, one static batch per
    temperature."""
    ref: dict[int, list[int]] = {}
    for temp in (0.0, 0.8):
        idx = [i for i, r in enumerate(reqs) if r.get("temperature", 0.0) == temp]
        out = specjax.generate(
            model,
            [reqs[i]["tokens"] for i in idx],
            max_new_tokens=[reqs[i]["n_predict"] for i in idx],
            seed=[reqs[i]["seed"] for i in idx],
            temperature=temp,
            n_ctx=N_CTX,
        )
        for i, toks in zip(idx, out.tokens):
            ref[i + 1] = toks
    return ref


def run_job(model, reqs, out, **kw) -> batching.BatchSummary:
    kw.setdefault("n_ctx", N_CTX)
    kw.setdefault("prefill_chunk", CHUNK)
    kw.setdefault("progress", False)
    return specjax.batch(model, reqs, out, **kw)


def records(path) -> dict:
    recs = batching.read_results(path, repair=False)
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids)), "an id was written twice"
    return {r["id"]: r for r in recs}


def test_bad_lines_reported_with_numbers_before_anything_runs(model, tmp_path):
    lines = [
        json.dumps({"prompt": "def f(x):", "n_predict": 4}),  # 1 ok
        '{"prompt": "x", ',  # 2 invalid JSON
        json.dumps({"prompt": "a", "temprature": 0.5}),  # 3 unknown key
        json.dumps({"prompt": ""}),  # 4 empty prompt
        json.dumps({"tokens": [5] * N_CTX}),  # 5 prompt larger than the context
        "",  # blank: not a request
        json.dumps({"id": "a", "tokens": [3, 4]}),  # 7 ok
        json.dumps({"id": "a", "tokens": [5]}),  # 8 duplicate id
        json.dumps({"tokens": [3], "temperature": "hot"}),  # 9 not a number
        json.dumps({"tokens": [3], "prompt": "x"}),  # 10 both
        json.dumps({"tokens": [3, 10**6]}),  # 11 out of the vocabulary
        json.dumps({"tokens": [3], "n_predict": 0}),  # 12 n_predict 0
        json.dumps({"tokens": [3], "min_p": 1.5}),  # 13 min_p above 1
        json.dumps([1, 2]),  # 14 not an object
        json.dumps({"id": 7.5, "tokens": [3]}),  # 15 bad id type
    ]
    src = tmp_path / "req.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    with pytest.raises(batching.BatchInputError) as info:
        run_job(model, src, out)
    bad = [e.line for e in info.value.errors]
    assert bad == [2, 3, 4, 5, 8, 9, 10, 11, 12, 13, 14, 15]
    msg = str(info.value)
    assert "line 5: prompt of 128 tokens does not fit a context of 128" in msg
    assert "line 8: duplicate id 'a' (first on line 7)" in msg
    assert "'temprature'" in msg
    assert not out.exists()

    errors = tmp_path / "errors.jsonl"
    summary = run_job(model, src, out, errors_path=errors, n_parallel=1, n_predict=16)
    written = [json.loads(x) for x in errors.read_text().splitlines()]
    assert [e["line"] for e in written] == bad
    assert written[0]["text"] == lines[1]
    assert summary.n_errors == len(bad) and summary.n_done == 2
    assert sorted(map(str, records(out))) == ["1", "a"]


def test_records_independent_of_slots_and_speculation(model, spec, draft, tmp_path):
    reqs = make_requests(model, 14, seed=0)
    ref = reference(model, reqs)
    for name, kw in [
        ("np1", dict(n_parallel=1)),
        ("spec4", dict(n_parallel=4, spec=spec, draft=draft)),
    ]:
        out = tmp_path / f"{name}.jsonl"
        log = io.StringIO()
        summary = run_job(model, reqs, out, progress=True, log=log, **kw)
        # the progress bar: requests done, tokens/s, and acceptance with speculation
        bar = log.getvalue()
        assert "14/14" in bar and "tok/s=" in bar
        assert ("acc=" in bar) == ("spec" in kw)
        got = records(out)
        assert sorted(got) == sorted(ref), name
        for rid, rec in got.items():
            assert rec["tokens"] == ref[rid], (name, rid)
            r = reqs[rid - 1]
            if rec["finish_reason"] == "length":
                assert len(rec["tokens"]) == r["n_predict"]
            assert rec["timings"]["prompt_tokens"] == len(r["tokens"])
            assert rec["text"] == model.decode(rec["tokens"])
        # per-request statistics add up to the job's counters (llama.cpp's, kept apart)
        drafted = [r["stats"]["drafted_tokens"] for r in got.values()]
        accepted = [r["stats"]["accepted_tokens"] for r in got.values()]
        assert all(0 <= a <= d for a, d in zip(accepted, drafted))
        if "spec" in kw:
            job = summary.stats.to_dict()
            assert 0 < job["num_accepted_tokens"] < job["num_draft_tokens"]
            assert sum(drafted) == job["num_draft_tokens"]
            assert sum(accepted) == job["num_accepted_tokens"]
            for rec in got.values():
                st = rec["stats"]
                if st["drafted_tokens"]:
                    assert st["acceptance_rate"] == st["accepted_tokens"] / st["drafted_tokens"]
        else:
            assert sum(drafted) == 0


def test_resume_skips_finished_ids_and_repairs_a_torn_line(model, tmp_path):
    reqs = make_requests(model, 9, seed=1)
    full = tmp_path / "full.jsonl"
    run_job(model, reqs, full, n_parallel=1)
    want = records(full)
    lines = full.read_text().splitlines(keepends=True)
    part = tmp_path / "part.jsonl"
    # three whole lines and half of the fourth: a crash mid-write
    part.write_text("".join(lines[:3]) + lines[3][: len(lines[3]) // 2])
    log = io.StringIO()
    summary = run_job(model, reqs, part, n_parallel=1, log=log)
    assert summary.n_skipped == 3 and summary.n_done == 6
    assert "9 request(s) in requests; skipped 3 already in" in log.getvalue()
    got = records(part)
    assert {k: v["tokens"] for k, v in got.items()} == {k: v["tokens"] for k, v in want.items()}
    again = run_job(model, reqs, part, n_parallel=1)
    assert again.n_skipped == 9 and again.n_done == 0
    assert len(part.read_text().splitlines()) == 9


def test_new_requests_never_recompile(model, spec, draft, tmp_path):
    kw = dict(n_parallel=4, spec=spec, draft=draft)
    run_job(model, make_requests(model, 6, seed=2), tmp_path / "a.jsonl", **kw)
    with count_compiles() as events:
        other = make_requests(model, 10, seed=3)
        for r in other:
            r.update(top_k=5, top_p=0.9, min_p=0.05)
        run_job(model, other, tmp_path / "b.jsonl", **kw)
    assert events == []
