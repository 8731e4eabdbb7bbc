"""llama.cpp lookup cache files and tools (`specjax.io.lookup`).

Byte-level expectations were cross-checked against upstream's `common/ngram-cache.cpp`; the
`peers` tests repeat that with llama.cpp's own tools when `SPECJAX_LLAMACPP_BIN` points at a
build's bin directory (llama-lookup-merge; llama-lookup-create/-stats also need a GGUF model in
`SPECJAX_LLAMACPP_MODEL`).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracles import ngram_cache_reference as ref

from specjax.drafters.base import DraftInput, TokenHistory
from specjax.drafters.ngram_cache import NgramCache, context_cache
from specjax.errors import ModelFileError
from specjax.io import lookup

TEXT = (
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n    return a / b\n"
) * 3
TOKENS = list(TEXT.encode())

ngrams = st.tuples(*[st.integers(-1, 40)] * 4)
counts = st.integers(1, 2**31 - 1)
parts = st.dictionaries(st.integers(0, 40), counts, min_size=1, max_size=5)
caches = st.dictionaries(ngrams, parts, max_size=12)
small = st.dictionaries(
    ngrams,
    st.dictionaries(st.integers(0, 40), st.integers(1, 1000), min_size=1, max_size=5),
    max_size=12,
)


def brute_counts(tokens: list[int], size: int) -> dict[tuple[int, ...], dict[int, int]]:
    out: dict[tuple[int, ...], dict[int, int]] = {}
    for i in range(size, len(tokens)):
        ng = tuple(tokens[i - size : i]) + (-1,) * (4 - size)
        out.setdefault(ng, {}).setdefault(tokens[i], 0)
        out[ng][tokens[i]] += 1
    return out


# --------------------------------------------------------------------------------------------
# file format
# --------------------------------------------------------------------------------------------


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(caches)
def test_round_trip_is_byte_identical(tmp_path: Path, cache: dict[Any, dict[int, int]]) -> None:
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    lookup.save_cache(a, cache)
    loaded = lookup.load_cache(a)
    assert loaded == cache and list(loaded) == list(cache)
    assert all(list(loaded[k]) == list(cache[k]) for k in cache)
    lookup.save_cache(b, loaded)
    assert a.read_bytes() == b.read_bytes()


def test_layout_is_llamacpp_records(tmp_path: Path) -> None:
    cache = {(1, 2, -1, -1): {7: 3, 9: 1}, (5, -1, -1, -1): {6: 2}}
    path = tmp_path / "c.bin"
    lookup.save_cache(path, cache)
    words = [1, 2, -1, -1, 2, 7, 3, 9, 1, 5, -1, -1, -1, 1, 6, 2]
    assert path.read_bytes() == struct.pack(f"={len(words)}i", *words)
    (tmp_path / "empty.bin").write_bytes(b"")
    assert lookup.load_cache(tmp_path / "empty.bin") == {}


# two records: (1,2,-1,-1) -> {7: 3} at bytes 0..27, (5,-1,-1,-1) -> {6: 2} at bytes 28..55
@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [
        (lambda b: b[:-3], r"truncated record at byte offset 28: 1 tokens need 28 bytes, 25 left"),
        (lambda b: b[:30], r"truncated record at byte offset 28: needs 20 bytes .*, 2 left"),
        (lambda b: b[:36], r"truncated record at byte offset 28: needs 20 bytes"),
        (lambda b: b[:16], r"truncated record at byte offset 0: needs 20 bytes"),
        (lambda b: b[:16] + struct.pack("=i", 0) + b[20:], r"token count 0 at byte offset 16"),
        (lambda b: b[:16] + struct.pack("=i", -3) + b[20:], r"token count -3 at byte offset 16"),
        (lambda b: b[:16] + struct.pack("=i", 5) + b[20:], r"5 tokens need 60 bytes, 56 left"),
        (lambda b: b[:24] + struct.pack("=i", 0) + b[28:], r"count 0 of token 7 at byte offset 24"),
        (lambda b: b + b"\x01\x02", r"truncated record at byte offset 56: needs 20 .*, 2 left"),
    ],
)
def test_corrupted_files_raise(tmp_path: Path, mutate: Any, pattern: str) -> None:
    path = tmp_path / "bad.bin"
    lookup.save_cache(path, {(1, 2, -1, -1): {7: 3}, (5, -1, -1, -1): {6: 2}})
    data = path.read_bytes()
    assert len(data) == 56
    path.write_bytes(mutate(data))
    with pytest.raises(ModelFileError, match=pattern) as e:
        lookup.load_cache(path)
    assert str(path) in str(e.value)


def test_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="cannot read lookup cache"):
        lookup.load_cache(tmp_path / "nope.bin")


def test_failed_save_keeps_existing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "keep.bin"
    lookup.save_cache(path, {(1, -1, -1, -1): {2: 1}})
    old = path.read_bytes()
    with pytest.raises(ValueError, match="count 0"):
        lookup.save_cache(path, {(1, -1, -1, -1): {2: 0}})
    with pytest.raises(ValueError, match="not an int32"):
        lookup.save_cache(path, {(1, -1, -1, -1): {2**31: 1}})

    def boom(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="No space"):
        lookup.save_cache(path, {(3, -1, -1, -1): {4: 5}})
    assert path.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.bin"]  # no temp file left


# --------------------------------------------------------------------------------------------
# create / merge
# --------------------------------------------------------------------------------------------


def test_create_counts_bigrams_in_llamacpp_order() -> None:
    cache = lookup.create_static_cache(TOKENS)
    assert cache == brute_counts(TOKENS, 2)
    want_order = ref.cache_keys(ref.build_cache(TOKENS, 2, 2))
    assert list(cache) == want_order
    assert lookup.create_static_cache(TOKENS, 3) == brute_counts(TOKENS, 3)
    with pytest.raises(ValueError):
        lookup.create_static_cache(TOKENS, 5)


@settings(max_examples=40, deadline=None)
@given(small, small, small)
def test_merge_adds_counts(a: Any, b: Any, c: Any) -> None:
    before = [ref.copy_cache(x) for x in (a, b, c)]
    merged = lookup.merge_caches(a, b, c)
    assert set(merged) == set(a) | set(b) | set(c)
    for ng in merged:
        toks = set(a.get(ng, {})) | set(b.get(ng, {})) | set(c.get(ng, {}))
        assert merged[ng] == {t: sum(x.get(ng, {}).get(t, 0) for x in (a, b, c)) for t in toks}
    assert [a, b, c] == before  # inputs are not modified
    # the result is in llama.cpp's save order: re-merging it into nothing keeps the counts
    assert lookup.merge_caches({}, merged) == merged


def test_merge_cli_and_update_dynamic(tmp_path: Path) -> None:
    p1, p2, out = tmp_path / "1.bin", tmp_path / "2.bin", tmp_path / "m.bin"
    lookup.save_cache(p1, {(1, -1, -1, -1): {2: 1, 3: 4}})
    lookup.save_cache(p2, {(1, -1, -1, -1): {3: 1}, (9, 9, -1, -1): {1: 1}})
    assert lookup.lookup_merge_main([str(p1), str(p2), str(out)]) == 0
    assert lookup.load_cache(out) == {(1, -1, -1, -1): {2: 1, 3: 5}, (9, 9, -1, -1): {1: 1}}
    dyn = tmp_path / "dyn.bin"
    lookup.update_dynamic_cache(dyn, {(4, -1, -1, -1): {5: 2}})
    lookup.update_dynamic_cache(dyn, {(4, -1, -1, -1): {5: 1, 6: 1}})
    assert lookup.load_cache(dyn) == {(4, -1, -1, -1): {5: 3, 6: 1}}
    (tmp_path / "bad.bin").write_bytes(b"\x00" * 7)
    assert lookup.lookup_merge_main([str(tmp_path / "bad.bin"), str(out)]) == 1


# --------------------------------------------------------------------------------------------
# lookup-stats
# --------------------------------------------------------------------------------------------


PAD = (2048, 2048, 64, 32)  # one table shape for every chunk's dynamic cache: one compilation


@functools.cache
def _device_fns(n_draft: int) -> tuple[NgramCache, Any, Any]:
    drafter = NgramCache(n_draft=n_draft, table_size=512, block=16, context_update="lookup")
    draft = jax.jit(functools.partial(drafter.draft, k_max=n_draft))
    return drafter, draft, jax.jit(drafter.ingest)


def _pseudo_output(hist: jax.Array, sl: list[int], n: int) -> DraftInput:
    """lookup-stats' `pseudo_output = sl[:n]` as drafter input: history sl[:n-1], last sl[n-1]."""
    return DraftInput(
        history=TokenHistory(tokens=hist, length=jnp.asarray([n - 1], jnp.int32)),
        last_token=jnp.asarray([sl[n - 1]], jnp.int32),
        n_max=jnp.zeros((1,), jnp.int32),
        drafting=jnp.ones((1,), bool),
        n_min=jnp.int32(0),
        p_min=jnp.float32(0.0),
        temperature=jnp.zeros((1,), jnp.float32),
    )


def _stats_on_device(
    tokens: list[int], static: Any, dynamic: Any, n_draft: int, n_ctx: int
) -> tuple[int, int]:
    """lookup-stats driven through the JAX drafter (context_update='lookup'; the device context
    cache is exported and merged into the dynamic cache after each chunk): an independent
    implementation of the drafting side."""
    drafter, draft, ingest = _device_fns(n_draft)
    dyn = ref.copy_cache(dynamic or {})  # in-memory order, as upstream's merges keep it
    n_drafted = n_accept = 0
    i_start = 0
    while i_start + n_ctx < len(tokens):
        sl = tokens[i_start : i_start + n_ctx]
        params = lookup.tables_from_cache(static, dyn, PAD)
        hist = jnp.asarray(np.asarray(sl, np.int32)[None, :])

        upto = functools.partial(_pseudo_output, hist, sl)
        state = drafter.init(1, n_ctx)
        n = 1
        while n < n_ctx:
            state, out = draft(params, state, upto(n))
            d = [int(t) for t in np.asarray(out.tokens[0])[: int(out.length[0])]]
            n_drafted += len(d)
            for t in d:
                if n >= n_ctx or sl[n] != t:
                    break
                n_accept += 1
                n += 1
            n = min(n + 1, n_ctx)
        end = upto(n_ctx)  # count the chunk's last tokens before merging, as upstream does
        state = ingest(
            state, end.history.tokens, end.history.length, end.last_token, jnp.ones((1,), bool)
        )
        assert int(state.n_dropped[0]) == 0
        ref.ngram_cache_merge(dyn, context_cache(state, 0))
        i_start += n_ctx
    return n_drafted, n_accept


@pytest.mark.parametrize(("n_draft", "n_ctx", "with_files"), [(4, 100, False), (4, 64, True)])
def test_lookup_stats_matches_device_replay(n_draft: int, n_ctx: int, with_files: bool) -> None:
    tokens = TOKENS
    static = lookup.create_static_cache(tokens[::-1]) if with_files else None
    dynamic = lookup.create_static_cache(tokens[:50], 3) if with_files else None
    s = lookup.lookup_stats(tokens, static, dynamic, n_draft, n_ctx)
    assert s.n_predict == len(tokens) - len(tokens) % n_ctx
    assert s.n_drafted > 0 and 0 < s.n_accept <= s.n_drafted
    assert (s.n_drafted, s.n_accept) == _stats_on_device(tokens, static, dynamic, n_draft, n_ctx)


def test_lookup_stats_small_example_by_hand() -> None:
    """'1 2 1 2 ...' (11 tokens, one chunk of 10, n_draft 2). Nothing passes the thresholds until
    out = [1,2,1,2,1]: (1,2,1) -> 2 seen once (size 3 needs 1 sample) and (1,2,1,2) -> 1: draft
    [2, 1], both accepted (7 tokens) + sampled 2; at 8 tokens draft [1, 2], both accepted (10).
    llama.cpp's common/ngram-cache.cpp gives the same (10, 4, 4)."""
    s = lookup.lookup_stats([1, 2] * 5 + [1], n_draft=2, n_ctx=10)
    assert (s.n_predict, s.n_drafted, s.n_accept) == (10, 4, 4)
    assert s.lines()[0] == "n_draft      = 2"
    assert s.lines()[-1] == "accept       = 100.000%"
    assert lookup.LookupStats(3, 0, 0, 0).lines()[-1] == "accept       = n/a (nothing drafted)"
    assert "nan" not in "".join(lookup.LookupStats(3, 0, 0, 0).lines())
    assert lookup.lookup_stats([1, 2] * 5, n_ctx=10).n_predict == 10  # last chunk not replayed
    assert lookup.lookup_stats([1, 2] * 5, n_ctx=10).n_drafted == 0


def test_cli_create_and_stats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 4)
    lcs = tmp_path / "static.bin"
    assert lookup.lookup_create_main(["--byte-tokens", "-f", str(text), "-lcs", str(lcs)]) == 0
    assert lookup.load_cache(lcs) == brute_counts(list((TEXT * 4).encode()), 2)
    rc = lookup.lookup_stats_main(
        [
            "--byte-tokens",
            "-f",
            str(text),
            "-lcs",
            str(lcs),
            "-lcd",
            str(tmp_path / "missing.bin"),
            "--spec-draft-n-max",
            "4",
            "-c",
            "200",
        ]
    )
    assert rc == 0
    err = capsys.readouterr().err
    s = lookup.lookup_stats(list((TEXT * 4).encode()), lookup.load_cache(lcs), None, 4, 256)
    for line in (
        "n_draft      = 4",
        f"n_predict    = {s.n_predict}",
        f"n_drafted    = {s.n_drafted}",
        f"n_accept     = {s.n_accept}",
        f"accept       = {s.accept_percent:.3f}%",
    ):
        assert line in err
    assert re.search(r"t_draft      = [0-9.]+ ms, [0-9.]+ us per token, [0-9.a-z]+ tokens per", err)
    (tmp_path / "bad.bin").write_bytes(b"\x00" * 9)
    assert (
        lookup.lookup_stats_main(
            ["--byte-tokens", "-f", str(text), "-lcs", str(tmp_path / "bad.bin")]
        )
        == 1
    )


def test_tables_from_cache_round_trip_lookups() -> None:
    cache = lookup.create_static_cache(TOKENS)
    table = lookup.tables_from_cache(cache, None).static
    keys = np.asarray(table.ng_keys)
    off, ln = np.asarray(table.ng_off), np.asarray(table.ng_len)
    toks, cnts = np.asarray(table.ent_tok), np.asarray(table.ent_count)
    back = {
        tuple(int(x) for x in keys[g]): dict(
            zip(
                toks[off[g] : off[g] + ln[g]].tolist(),
                cnts[off[g] : off[g] + ln[g]].tolist(),
                strict=True,
            )
        )
        for g in range(len(keys))
    }
    assert back == cache
    for ng, part in back.items():  # parts are stored in libstdc++ iteration order
        assert list(part.items()) == ref.part_items(cache[ng])
    assert lookup.tables_from_cache(None, {}) is None


# --------------------------------------------------------------------------------------------
# llama.cpp's own tools (peers)
# --------------------------------------------------------------------------------------------

BIN = os.environ.get("SPECJAX_LLAMACPP_BIN")
MODEL = os.environ.get("SPECJAX_LLAMACPP_MODEL")


def _tool(name: str) -> str:
    path = shutil.which(name, path=BIN) if BIN else None
    if not path:
        pytest.skip(f"{name} not found (set SPECJAX_LLAMACPP_BIN to llama.cpp's bin directory)")
    return path


@pytest.mark.peers
def test_peer_lookup_merge_same_bytes(tmp_path: Path) -> None:
    tool = _tool("llama-lookup-merge")
    files = []
    for k, chunk in enumerate((TOKENS[:200], TOKENS[150:400], TOKENS[::3])):
        p = tmp_path / f"{k}.bin"
        lookup.save_cache(p, ref.to_file_order(ref.build_cache(chunk, 1, 4)))
        files.append(str(p))
    subprocess.run([tool, *files, str(tmp_path / "theirs.bin")], check=True, capture_output=True)
    assert lookup.lookup_merge_main([*files, str(tmp_path / "ours.bin")]) == 0
    assert (tmp_path / "theirs.bin").read_bytes() == (tmp_path / "ours.bin").read_bytes()


@pytest.mark.peers
def test_peer_lookup_create_and_stats(tmp_path: Path) -> None:
    create, stats = _tool("llama-lookup-create"), _tool("llama-lookup-stats")
    if not MODEL:
        pytest.skip("set SPECJAX_LLAMACPP_MODEL to a GGUF model for its tokenizer")
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 20)
    subprocess.run(
        [create, "-m", MODEL, "-f", str(text), "-lcs", str(tmp_path / "theirs.bin")],
        check=True,
        capture_output=True,
    )
    assert (
        lookup.lookup_create_main(
            ["-m", MODEL, "-f", str(text), "-lcs", str(tmp_path / "ours.bin")]
        )
        == 0
    )
    assert (tmp_path / "theirs.bin").read_bytes() == (tmp_path / "ours.bin").read_bytes()
    args = [
        "-f",
        str(text),
        "-lcs",
        str(tmp_path / "theirs.bin"),
        "-c",
        "256",
        "--spec-draft-n-max",
        "5",
    ]
    theirs = subprocess.run(
        [stats, "-m", MODEL, *args], check=True, capture_output=True, text=True
    ).stderr
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        assert lookup.lookup_stats_main(["-m", MODEL, *args]) == 0
    for key in ("n_draft", "n_predict", "n_drafted", "n_accept", "accept "):
        mine = [ln for ln in buf.getvalue().splitlines() if ln.startswith(key)]
        peer = [ln.split("] ")[-1] for ln in theirs.splitlines() if key in ln]
        assert mine and peer and mine[0] in peer[-1]
