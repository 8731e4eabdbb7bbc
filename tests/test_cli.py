"""`specjax generate` end to end on a tiny GGUF model written in the test."""

from __future__ import annotations

import json
import re

import pytest

from specjax.cli import command as cli
from specjax.io.gguf_io import save_gguf
from specjax.testing import tiny_model_with_tokenizer


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    model = tiny_model_with_tokenizer(0)
    path = tmp_path_factory.mktemp("m") / "tiny.gguf"
    save_gguf(str(path), model.config, model.params, model.tokenizer, dtype="f32")
    return str(path)


def test_generate_plain_and_speculative_agree(gguf_path, tmp_path, capsys):
    out_plain = tmp_path / "plain.jsonl"
    assert (
        cli.main(
            [
                "generate",
                "-m",
                gguf_path,
                "-p",
                "def add(a, b):",
                "-n",
                "12",
                "--out",
                str(out_plain),
            ]
        )
        == 0
    )
    plain_stdout = capsys.readouterr().out
    out_spec = tmp_path / "spec.jsonl"
    assert (
        cli.main(
            [
                "generate",
                "-m",
                gguf_path,
                "-md",
                gguf_path,
                "-p",
                "def add(a, b):",
                "-n",
                "12",
                "--spec-type",
                "draft-simple",
                "--spec-draft-n-max",
                "3",
                "--spec-governor",  # a self-draft never pays: keep llama.cpp's behaviour
                "off",
                "--out",
                str(out_spec),
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert captured.out == plain_stdout and captured.out.startswith("def add(a, b):")
    assert "statistics     draft-simple: #calls(b,g,a)" in captured.err
    assert "draft acceptance = 1.00000" in captured.err  # the model drafts for itself
    plain = json.loads(out_plain.read_text())
    spec = json.loads(out_spec.read_text())
    assert plain["tokens"] == spec["tokens"] and len(spec["tokens"]) <= 12
    assert {"generated_tokens", "decode_seconds", "prefill_seconds"} <= set(spec["timings"])
    assert spec["stats"]["num_draft_tokens"] == spec["stats"]["num_accepted_tokens"] > 0
    assert "stats" not in plain


def test_config_preset_and_override(gguf_path, tmp_path, capsys):
    preset = tmp_path / "preset.yaml"
    preset.write_text(f"model: {gguf_path}\nprompt: 'import os'\nn_predict: 5\n")
    out = tmp_path / "o.jsonl"
    assert cli.main(["generate", "--config", str(preset), "-n", "3", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["prompt"] == "import os" and len(record["tokens"]) <= 3
    capsys.readouterr()


def test_cli_errors_are_clear(gguf_path, tmp_path, capsys):
    assert cli.main(["generate", "-m", gguf_path, "-p", "x", "--spec-type", "ngram-bogus"]) == 1
    assert "unknown speculative type: ngram-bogus" in capsys.readouterr().err
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    assert cli.main(["generate", "-m", str(bad), "-p", "x"]) == 1
    assert str(bad) in capsys.readouterr().err
    with pytest.raises(SystemExit, match="needs -md"):
        cli.main(["generate", "-m", gguf_path, "-p", "x", "--spec-type", "draft-simple"])


@pytest.mark.slow  # suite time: lookup files are also covered by tests/test_lookup_files.py
def test_lookup_caches_static_in_dynamic_out(gguf_path, tmp_path, capsys):
    from specjax.io.lookup import load_cache

    corpus = tmp_path / "corpus.py"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 20)
    static = tmp_path / "static.bin"
    assert cli.main(["lookup-create", "-m", gguf_path, "-f", str(corpus), "-lcs", str(static)]) == 0
    assert load_cache(static)  # n-gram size 2 records from the corpus
    dynamic = tmp_path / "dynamic.bin"
    args = [
        "generate",
        "-m",
        gguf_path,
        "-p",
        "def add(a, b):",
        "-n",
        "16",
        "--spec-type",
        "ngram-cache",
        "-lcs",
        str(static),
        "-lcd",
        str(dynamic),
    ]
    assert cli.main(args) == 0
    first = load_cache(dynamic)
    assert first, "the run's context cache must be saved into the dynamic cache"
    assert cli.main(args) == 0
    second = load_cache(dynamic)
    total = lambda c: sum(sum(v.values()) for v in c.values())  # noqa: E731
    assert total(second) == 2 * total(first)  # same greedy run merged twice: counts add up
    assert "statistics      ngram-cache" in capsys.readouterr().err


def test_stop_strings_cut_text_and_tokens(gguf_path):
    import specjax

    model = specjax.load(gguf_path)
    full = specjax.generate(model, ["def add(a, b):"], max_new_tokens=16)
    text = full.text[0]
    assert len(text) > 4
    stop = text[2:4]
    cut = specjax.generate(model, ["def add(a, b):"], max_new_tokens=16, stop=[stop])
    assert cut.text[0] == text[: text.find(stop)]
    assert cut.finish_reasons == ["stop"]
    assert cut.tokens[0] == full.tokens[0][: len(cut.tokens[0])]
    assert stop in model.decode(cut.tokens[0])


def test_text_prompts_follow_the_models_add_bos(gguf_path, tmp_path, capsys):
    """llama.cpp tokenizes `-p`/`-f` text with add_special: BOS first when the GGUF says
    `tokenizer.ggml.add_bos_token = true` (the tiny fixture's tokenizer says false)."""
    import specjax
    from specjax.io.tokenizer import Tokenizer

    model = specjax.load(gguf_path)
    tok = model.tokenizer
    assert not tok.add_bos
    with_bos = Tokenizer(tok.hf_tokenizer, bos_id=0, eos_id=1, pad_id=2, add_bos=True)
    path = tmp_path / "bos.gguf"
    save_gguf(str(path), model.config, model.params, with_bos, dtype="f32")
    records = {}
    for name, m in (("plain", gguf_path), ("bos", str(path))):
        out = tmp_path / f"{name}.jsonl"
        assert cli.main(["generate", "-m", m, "-p", "import os", "-n", "2", "--out", str(out)]) == 0
        records[name] = json.loads(out.read_text())
    capsys.readouterr()
    ids = tok.encode("import os")
    assert records["plain"]["prompt_tokens"] == ids
    assert records["bos"]["prompt_tokens"] == [0, *ids]


def test_prompt_file_drops_one_trailing_newline(gguf_path, tmp_path, capsys):
    """llama.cpp's -f: read_file, then `if (prompt.back() == '\\n') prompt.pop_back();`."""
    cases = {
        "one.py": (b"import os\n", "import os"),
        "two.py": (b"import os\n\n", "import os\n"),
        "none.py": (b"import os", "import os"),
        "crlf.py": (b"import os\r\n", "import os\r"),  # bytes as read, no newline translation
        "empty.py": (b"", ""),
    }
    for name, (data, expected) in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        assert cli._read_prompts({"file": str(path)}) == [expected], name
    out_f, out_p = tmp_path / "f.jsonl", tmp_path / "p.jsonl"
    base = ["generate", "-m", gguf_path, "-n", "2", "--out"]
    assert cli.main([*base, str(out_f), "-f", str(tmp_path / "one.py")]) == 0
    assert cli.main([*base, str(out_p), "-p", "import os"]) == 0
    capsys.readouterr()
    record_f, record_p = json.loads(out_f.read_text()), json.loads(out_p.read_text())
    assert record_f["prompt"] == "import os"
    assert record_f["prompt_tokens"] == record_p["prompt_tokens"]


@pytest.mark.parametrize(
    "flags, types",
    [
        (["--spec-type", "ngram-mod", "--spec-type", "none"], ("ngram-mod",)),
        (["--spec-type", "ngram-mod,none", "--spec-type", "ngram-simple"], ("ngram-simple",)),
        (["--spec-type", "none", "--spec-default"], ("ngram-mod",)),
        (["--spec-type", "ngram-simple,none"], None),
    ],
)
def test_repeated_spec_type_none_empties_only_its_list(flags, types):
    spec = cli._spec_from_options(cli._load_options(["-m", "x", "-p", "y", *flags]))
    assert (spec.types if spec is not None else None) == types


def test_yaml_spec_type_list_items_are_separate_values(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("spec_type: [ngram-mod, 'ngram-simple,none']\n")
    spec = cli._spec_from_options(cli._load_options(["--config", str(preset)]))
    assert spec is not None and spec.types == ("ngram-mod",)


def test_each_spec_flag_sets_its_spec_config_field():
    """llama.cpp's `--spec-*` flags, each with a value unlike its default, land in the
    SpecConfig field of the same name."""
    fields = {
        "--spec-draft-n-max": ("draft_n_max", "7"),
        "--spec-draft-n-min": ("draft_n_min", "2"),
        "--spec-draft-p-min": ("draft_p_min", "0.25"),
        "--spec-draft-sampling": ("draft_sampling", "probabilistic"),
        "--spec-ngram-simple-size-n": ("ngram_simple_size_n", "5"),
        "--spec-ngram-simple-size-m": ("ngram_simple_size_m", "9"),
        "--spec-ngram-map-k-size-n": ("ngram_map_k_size_n", "6"),
        "--spec-ngram-map-k-size-m": ("ngram_map_k_size_m", "11"),
        "--spec-ngram-map-k-min-hits": ("ngram_map_k_min_hits", "3"),
        "--spec-ngram-map-k4v-size-n": ("ngram_map_k4v_size_n", "4"),
        "--spec-ngram-map-k4v-size-m": ("ngram_map_k4v_size_m", "13"),
        "--spec-ngram-map-k4v-min-hits": ("ngram_map_k4v_min_hits", "2"),
        "--spec-ngram-mod-n-match": ("ngram_mod_n_match", "10"),
        "--spec-ngram-mod-n-min": ("ngram_mod_n_min", "20"),
        "--spec-ngram-mod-n-max": ("ngram_mod_n_max", "30"),
    }
    flags = [part for flag, (_, value) in fields.items() for part in (flag, value)]
    spec = cli._spec_from_options(
        cli._load_options(["-m", "x", "-p", "y", "--spec-type", "ngram-mod", *flags])
    )
    assert spec is not None
    for flag, (field, value) in fields.items():
        want = value if field == "draft_sampling" else float(value)
        assert getattr(spec, field) == want, flag


def test_sampling_values_follow_llama_cpp(gguf_path, tmp_path, capsys):
    def run(*flags):
        out = tmp_path / "o.jsonl"
        args = ["generate", "-m", gguf_path, "-p", "import os", "--out", str(out), *flags]
        assert cli.main(args) == 0
        capsys.readouterr()
        return json.loads(out.read_text())

    sampled = ["-n", "6", "--temp", "1.5", "-s", "4"]
    reference = run(*sampled)["tokens"]
    assert run(*sampled, "--top-p", "1.5")["tokens"] == reference  # top-p >= 1 is off
    assert run(*sampled, "--top-k", "-2")["tokens"] == reference  # top-k <= 0 is off
    assert run(*sampled, "--min-p", "-1")["tokens"] == reference  # min-p <= 0 is off
    greedy = run("-n", "6", "--temp", "0")["tokens"]
    assert run("-n", "6", "--temp", "-1")["tokens"] == greedy  # --temp clamps to 0
    record = run("-n", "-1", "-c", "40")  # until the context is full (no EOG on this path)
    assert record["finish_reason"] == "context"
    assert len(record["tokens"]) == 40 - len(record["prompt_tokens"])  # n_ctx - L, as llama.cpp


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--repeat-penalty", "0"], "repeat_penalty must be finite and greater than 0"),
        (["--min-p", "2"], r"min_p must be in \[0, 1\], got 2.0"),
        (["-n", "0"], "max_new_tokens must be >= 1, or -1"),
        (["-n", "-5"], "got -5"),
    ],
)
def test_refused_sampling_values_are_errors(gguf_path, capsys, flags, message):
    assert cli.main(["generate", "-m", gguf_path, "-p", "x", *flags]) == 1
    assert re.search(message, capsys.readouterr().err)


def test_top_level_help_lists_the_subcommands(capsys):
    assert cli.main(["--help"]) == 0
    captured = capsys.readouterr()
    listed = [line.split()[0] for line in captured.out.splitlines() if line.startswith("  ")]
    assert listed == [
        "generate",
        "batch",
        "train",
        "train-draft",
        "lookup-create",
        "lookup-merge",
        "lookup-stats",
    ]
    assert "--n-predict" not in captured.out and captured.err == ""
    assert cli.main(["-h"]) == 0 and capsys.readouterr().out == captured.out
    assert cli.main([]) == 2 and capsys.readouterr().err == captured.out
    assert cli.main(["-m", "model.gguf"]) == 2
    assert "options go after a command: `specjax generate -m" in capsys.readouterr().err
    assert cli.main(["bogus"]) == 2
    assert "unknown command 'bogus'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # a command's own help: its options
        cli.main(["generate", "--help"])
    assert exit_info.value.code == 0 and "--n-predict" in capsys.readouterr().out
