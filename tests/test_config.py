"""SpecConfig parsing/validation and llama.cpp's helper functions."""

import pytest

from specjax.config import SpecConfig, output_limits, types_from_names, types_from_values
from specjax.drafters.base import DRAFTER_TYPES, PRIORITY


def test_output_limits_match_llama_cpp_vectors():
    # tests/test-arg-parser.cpp
    assert output_limits(16, 2, 3) == (8, 4)
    assert output_limits(16, 2, -1) == (2, 1)
    assert output_limits(6, 2, 3) == (6, 4)
    assert output_limits(2, 1, 3) == (2, 2)
    big = 2**31 - 1
    assert output_limits(big, big, big) == (big, big)


def test_types_follow_fixed_priority_not_given_order():
    assert types_from_names("draft-simple,ngram-mod") == ("ngram-mod", "draft-simple")
    assert types_from_names(["ngram-cache", "ngram-simple"]) == ("ngram-simple", "ngram-cache")
    assert types_from_names("ngram-mod,none") == ()
    assert len(DRAFTER_TYPES) == 11 and set(PRIORITY) == set(DRAFTER_TYPES) - {"none"}


def test_none_empties_only_its_own_list():
    # common/arg.cpp: each --spec-type value goes through common_speculative_types_from_names
    # and is appended to the list; a `none` there returns {NONE} for that value only.
    assert types_from_values(["ngram-mod", "none"]) == ("ngram-mod",)
    assert types_from_values(["ngram-mod,none", "draft-simple"]) == ("draft-simple",)
    assert types_from_values(["none", "draft-simple,ngram-simple"]) == (
        "ngram-simple",
        "draft-simple",
    )
    assert types_from_values(["none"]) == types_from_values([]) == ()
    assert types_from_values("ngram-mod,none") == ()  # one value = one list
    assert types_from_values(["ngram-mod", "ngram-mod"]) == ("ngram-mod",)
    # upstream returns at the first `none`: later names of that list are not looked at
    assert types_from_names("none,bogus") == ()
    with pytest.raises(ValueError, match="unknown speculative type: bogus"):
        types_from_names("bogus,none")
    with pytest.raises(ValueError, match="unknown speculative type: bogus"):
        types_from_values(["none", "bogus"])


def test_unknown_type_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown speculative type: eagle.*valid types: none"):
        types_from_names("eagle")


def test_defaults_and_n_max():
    spec = SpecConfig(types=("draft-simple",))
    assert (spec.draft_n_max, spec.draft_n_min, spec.draft_p_min) == (3, 0, 0.0)
    assert spec.n_max() == 3
    assert SpecConfig(types=("ngram-simple", "draft-simple")).n_max() == 48
    assert SpecConfig.default().types == ("ngram-mod",)
    assert SpecConfig.default().n_max() == 64
    assert SpecConfig(types=("ngram-cache",)).n_max() == 8
    assert not SpecConfig(types=("none",)).enabled


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(draft_n_max=-1), "draft n_max must be >= 0, got -1"),
        (dict(draft_p_min=1.5), r"p_min must be in \[0, 1\], got 1.5"),
        (dict(ngram_simple_size_n=0), "ngram_simple size_n must be in 1..1024, got 0"),
        (dict(ngram_mod_n_match=2000), "n_match must be in 1..1024, got 2000"),
        (dict(ngram_map_k4v_min_hits=0), "ngram_map_k4v_min_hits must be >= 1, got 0"),
        (dict(synth_len=2.0, synth_rates=(0.5,)), "mutually exclusive"),
    ],
)
def test_invalid_values_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpecConfig(types=("draft-simple",), **kwargs)


def test_round_trip_dict():
    spec = SpecConfig(types=("ngram-mod", "draft-simple"), draft_n_max=5, synth_rates=(0.9, 0.5))
    assert SpecConfig.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="unknown speculative config keys: bogus"):
        SpecConfig.from_dict({"bogus": 1})
