"""The TPU form of draft-simple's and draft-eagle3's draft loops
(`control.draft_steps_in_cache`): the loop's steps write their K/V into the loop-carried draft
cache instead of a scratch (draft-simple commits the scratch after the loop, draft-eagle3 drops
its drafted rows). Run here on CPU with the switch forced on: speculative greedy equals plain
greedy, drafts are made and some rejected, the drafts are the scratch form's (the same
statistics), and the draft loop really carried the cache. (That the form copies no
cache-sized buffer on a TPU v6e is tests/test_accelerators.py's, compiled deviceless.)"""

from __future__ import annotations

from typing import Any

import jax
import pytest

from specjax import api
from specjax.api import generate
from specjax.config import SpecConfig
from specjax.drafters import draft_simple, eagle3
from specjax.memory.kv import KVCache
from specjax.testing import noisy_copy, tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34], [40], [41, 42]]
MAX_NEW = [26, 26, 12, 26, 20]


def _both_forms(
    monkeypatch: Any, target: Any, spec: SpecConfig, draft: Any, patches: dict[tuple[Any, str], Any]
) -> tuple[Any, Any]:
    """(the scratch form's result, the cache form's): the second traced afresh with the
    drafter module's switch on and `patches` ((object, name): value) applied."""
    scratch = generate(target, PROMPTS, max_new_tokens=MAX_NEW, spec=spec, draft=draft)
    api.clear_compiled()
    jax.clear_caches()  # trace again, with the switch on
    for (obj, name), value in patches.items():
        monkeypatch.setattr(obj, name, value)
    out = generate(target, PROMPTS, max_new_tokens=MAX_NEW, spec=spec, draft=draft)
    api.clear_compiled()
    jax.clear_caches()
    return scratch, out


def _check(out: Any, scratch: Any, plain: Any) -> None:
    """Lossless, drafts made and some rejected, the same drafts as the scratch form."""
    assert out.tokens == plain.tokens == scratch.tokens
    stats = out.stats.to_dict()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert stats == scratch.stats.to_dict()


@pytest.mark.usefixtures("no_compile_cache")
def test_draft_steps_written_into_the_cache_are_lossless(monkeypatch: Any) -> None:
    target = tiny_model(0)
    plain = generate(target, PROMPTS, max_new_tokens=MAX_NEW)
    carried: list[type] = []
    step = draft_simple.DraftSimple._loop_step

    def recording_step(self: Any, params: Any, state: Any, carry: Any, *rest: Any) -> Any:
        carried.append(type(carry))
        return step(self, params, state, carry, *rest)

    spec = SpecConfig(types=("draft-simple",), adaptive=False, draft_n_max=5)
    patches = {
        (draft_simple, "draft_steps_in_cache"): lambda: True,
        (draft_simple.DraftSimple, "_loop_step"): recording_step,
    }
    scratch, out = _both_forms(monkeypatch, target, spec, noisy_copy(target, 0.6), patches)
    assert carried and set(carried) == {KVCache}
    _check(out, scratch, plain)


@pytest.mark.usefixtures("no_compile_cache")
def test_eagle3_draft_steps_written_into_the_cache_are_lossless(monkeypatch: Any) -> None:
    from test_eagle3 import echo_head

    target = tiny_model(0)
    head = echo_head(target)
    plain = generate(target, PROMPTS, max_new_tokens=MAX_NEW)
    carried: list[type] = []
    compute = eagle3.e3.decoder_compute

    def recording_compute(*args: Any, **kw: Any) -> Any:
        carried.append(type(args[6]))  # the cache (or the cache the scratch sits beside)
        carried.append(type(kw.get("extra")))
        return compute(*args, **kw)

    spec = SpecConfig(types=("draft-eagle3",), adaptive=False, draft_n_max=4)
    patches = {
        (eagle3, "draft_steps_in_cache"): lambda: True,
        (eagle3.e3, "decoder_compute"): recording_compute,
    }
    scratch, out = _both_forms(monkeypatch, target, spec, head, patches)
    assert carried and set(carried) == {KVCache, type(None)}  # no step read a scratch
    _check(out, scratch, plain)
