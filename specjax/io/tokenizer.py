"""Text <-> token ids, wrapping a Hugging Face `tokenizers.Tokenizer` with llama.cpp's vocab view.

Two vocabulary types, named as llama.cpp names them:

* ``"gpt2"``: byte-level BPE (tokens + merges + a pre-tokenizer regex, named in GGUF by
  ``tokenizer.ggml.pre``). Encode/decode round-trip any unicode string exactly.
* ``"llama"``: SentencePiece-style (tokens + scores + token types, "▁" for spaces, optional
  dummy space prefix, ``<0xXX>`` byte-fallback tokens). Built as a BPE whose merges are ranked by
  the score of the merged piece, which is llama.cpp's SPM algorithm (merge the adjacent pair
  whose concatenation is the best-scoring token). Ties between equal scores are broken by
  token id, not by position as llama.cpp does; real SPM vocabularies have distinct scores.

Invariants:
* Token ids are dense: ``vocab_size`` strings, id ``i`` is ``token_text(i)`` exactly as it
  appears in the GGUF token list (``Ġ``-encoded for byte-level BPE, ``▁`` for SPM).
* ``encode`` never adds special tokens on its own: ``add_bos=True`` prepends ``bos_id``.
  The ``add_bos`` / ``add_eos`` properties carry the model's preference for callers.
* Control tokens (GGUF token type 3) are "special": matched in text when ``parse_special`` is
  true, and dropped by ``decode(..., skip_special=True)``.
* ``eog_ids`` follows llama.cpp: eos, eot, eom, plus every token whose text is on
  llama.cpp's end-of-generation list (``<|eot_id|>``, ``<|im_end|>``, ``<|endoftext|>`` ...).

Supported GGUF pre-tokenizers (``tokenizer.ggml.pre``): see ``SUPPORTED_PRE``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from specjax.errors import ModelFileError
from specjax.types import ReadOnly

# llama.cpp token types (gguf.TokenType).
TOKEN_UNDEFINED = 0
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

SPIECE_SPACE = "▁"

# Pre-tokenizer regexes. Strings for llama3/qwen2 are the originals found in the models'
# tokenizer.json files (llama.cpp keeps them as comments next to its adapted copies).
_GPT2_CORE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# family -> regexes applied in sequence (llama.cpp's unicode_regex_split keeps both matches and
# the text between them, i.e. `Split(..., behavior="isolated")`). `None` = the GPT-2 regex of
# `pre_tokenizers.ByteLevel(use_regex=True)`.
_FAMILY_REGEXES: dict[str, tuple[str, ...] | None] = {
    "gpt2": None,
    "llama3": (_LLAMA3_RE,),
    "qwen2": (_QWEN2_RE,),
    "starcoder": (r"\p{N}", _GPT2_CORE),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_CORE, r"[0-9][0-9][0-9]"),
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_CORE, r"\p{N}+", r"[0-9][0-9][0-9]"),
}


def _names(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# llama.cpp pre-tokenizer name -> family (from src/llama-vocab.cpp).
_PRE_FAMILY: dict[str, str] = {
    **dict.fromkeys(
        _names(
            "gpt-2 phi-2 mpt olmo jais trillion granite-docling exaone4 mellum a.x-4.0 gigachat"
        ),
        "gpt2",
    ),
    **dict.fromkeys(
        _names(
            "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano "
            "dbrx smaug-bpe"
        ),
        "llama3",
    ),
    **dict.fromkeys(
        _names("qwen2 deepseek-r1-qwen kormo f2llmv2 stablelm2 hunyuan megrez"), "qwen2"
    ),
    **dict.fromkeys(
        _names("starcoder refact command-r smollm codeshell exaone minerva-7b"), "starcoder"
    ),
    "falcon": "falcon",
    "default": "default",
}
SUPPORTED_PRE: tuple[str, ...] = tuple(sorted(_PRE_FAMILY))

# llama.cpp sets ignore_merges (whole-word vocab hits skip BPE) and add_bos for these names.
_IGNORE_MERGES_PRE = frozenset(
    _names("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano")
)
_ADD_BOS_PRE = _IGNORE_MERGES_PRE

# Names written to GGUF for a family detected in a tokenizer.json.
_FAMILY_PRE_NAME = {
    "gpt2": "gpt-2",
    "llama3": "llama-bpe",
    "qwen2": "qwen2",
    "starcoder": "starcoder",
    "falcon": "falcon",
    "default": "default",
}

# Token texts llama.cpp treats as end-of-generation (src/llama-vocab.cpp).
EOG_TEXTS = frozenset(
    _names(
        "<|eot_id|> <|im_end|> <|end|> <|return|> <|call|> <|flush|> <|calls|> <end_of_turn> "
        "<|endoftext|> </s> <|eom_id|> <EOT> _<EOT> [EOT] [EOS] <|end_of_text|> "
        "<end_of_utterance> <eos> <turn|> <|tool_response> <｜end▁of▁sentence｜> [e~["
    )
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character byte-level BPE writes for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_UNICODE = _bytes_to_unicode()


def _byte_token(b: int) -> str:
    return f"<0x{b:02X}>"


def _pre_tokenizer_for(family: str) -> pre_tokenizers.PreTokenizer:
    regexes = _FAMILY_REGEXES[family]
    if regexes is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes
    ]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def _family_of_pre_tokenizer(spec: Mapping[str, Any] | None) -> str | None:
    """Which regex family a tokenizer.json pre_tokenizer implements (None if unknown)."""
    if not spec:
        return None
    if spec.get("type") == "ByteLevel":
        return "gpt2" if spec.get("use_regex", True) else None
    if spec.get("type") != "Sequence":
        return None
    steps = list(spec.get("pretokenizers", []))
    if not steps or steps[-1].get("type") != "ByteLevel" or steps[-1].get("use_regex", True):
        return None
    regexes = []
    for step in steps[:-1]:
        pattern = step.get("pattern", {})
        if (
            step.get("type") != "Split"
            or "Regex" not in pattern
            or str(step.get("behavior", "")).lower() != "isolated"
            or step.get("invert", False)
        ):
            return None
        regexes.append(pattern["Regex"])
    for family, known in _FAMILY_REGEXES.items():
        if known is not None and tuple(regexes) == known:
            return family
    return None


def _find_template_specials(spec: Mapping[str, Any] | None) -> tuple[list[str], list[str]]:
    """Special tokens a TemplateProcessing post-processor puts before / after a single text."""
    if not spec:
        return [], []
    if spec.get("type") == "Sequence":
        for sub in spec.get("processors", []):
            found = _find_template_specials(sub)
            if found != ([], []):
                return found
        return [], []
    if spec.get("type") != "TemplateProcessing":
        return [], []
    before: list[str] = []
    after: list[str] = []
    seen_text = False
    for piece in spec.get("single", []):
        if "Sequence" in piece:
            seen_text = True
        elif "SpecialToken" in piece:
            (after if seen_text else before).append(piece["SpecialToken"]["id"])
    return before, after


def _spm_merges(
    tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]
) -> list[tuple[str, str]]:
    """BPE merges equivalent to llama.cpp's SPM: rank a split of each normal token by its score."""
    normal = {t for t, ty in zip(tokens, types) if ty in (TOKEN_NORMAL, TOKEN_UNDEFINED)}
    ranked = []
    for i, (tok, ty) in enumerate(zip(tokens, types)):
        if ty not in (TOKEN_NORMAL, TOKEN_UNDEFINED) or len(tok) < 2:
            continue
        for k in range(1, len(tok)):
            left, right = tok[:k], tok[k:]
            if left in normal and right in normal:
                ranked.append((-float(scores[i]), i, k, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _token_content(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict[str, Any] | None:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{path}: cannot parse JSON ({e})") from e
    return data if isinstance(data, dict) else None


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the llama.cpp vocabulary metadata specjax needs."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        unk_id: int | None = None,
        eog_ids: Iterable[int] | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        vocab_type: str | None = None,
        pre: str | None = None,
        add_space_prefix: bool | None = None,
        tokens: Sequence[str] | None = None,
        token_types: Sequence[int] | None = None,
        scores: Sequence[float] | None = None,
    ) -> None:
        self._tok = tokenizer
        spec: dict[str, Any] | None = None
        if vocab_type is None or (vocab_type == "gpt2" and pre is None) or add_space_prefix is None:
            spec = json.loads(tokenizer.to_str())
        if vocab_type is None:
            vocab_type = self._detect_vocab_type(spec)
        if vocab_type not in ("gpt2", "llama"):
            raise ValueError(f"vocab_type must be 'gpt2' or 'llama', got {vocab_type!r}")
        self._vocab_type = vocab_type
        if vocab_type == "gpt2" and pre is None and spec is not None:
            family = _family_of_pre_tokenizer(spec.get("pre_tokenizer"))
            if family == "llama3" and not spec["model"].get("ignore_merges", False):
                pre = "smaug-bpe"
            elif family is not None:
                pre = _FAMILY_PRE_NAME[family]
        self._pre = pre
        if add_space_prefix is None:
            add_space_prefix = vocab_type == "llama" and self._detect_space_prefix(spec)
        self._add_space_prefix = bool(add_space_prefix)

        if tokens is None:
            vocab = tokenizer.get_vocab(with_added_tokens=True)
            n = max(vocab.values()) + 1 if vocab else 0
            table = [""] * n
            for text, i in vocab.items():
                table[i] = text
            tokens = table
        self._tokens = list(tokens)
        n = len(self._tokens)
        for name, value in (
            ("bos_id", bos_id),
            ("eos_id", eos_id),
            ("pad_id", pad_id),
            ("unk_id", unk_id),
        ):
            if value is not None and not 0 <= value < n:
                raise ValueError(f"{name}={value} is outside the vocabulary of {n} tokens")
        self._bos_id, self._eos_id, self._pad_id, self._unk_id = bos_id, eos_id, pad_id, unk_id
        self._add_bos, self._add_eos = bool(add_bos), bool(add_eos)

        added = tokenizer.get_added_tokens_decoder()
        if token_types is None:
            types = [TOKEN_NORMAL] * n
            for i, tok in added.items():
                if i < n:
                    types[i] = TOKEN_CONTROL if tok.special else TOKEN_USER_DEFINED
            if vocab_type == "llama":
                byte_names = {_byte_token(b) for b in range(256)}
                for i, text in enumerate(self._tokens):
                    if text in byte_names and i not in added:
                        types[i] = TOKEN_BYTE
            if unk_id is not None:
                types[unk_id] = TOKEN_UNKNOWN
            token_types = types
        if len(token_types) != n:
            raise ValueError(f"{len(token_types)} token types for {n} tokens")
        self._types = [int(t) for t in token_types]
        if scores is not None and len(scores) != n:
            raise ValueError(f"{len(scores)} scores for {n} tokens")
        self._scores = None if scores is None else [float(s) for s in scores]
        self._special_ids = frozenset(i for i, tok in added.items() if tok.special)

        if eog_ids is None:
            eog = {i for i, text in enumerate(self._tokens) if text in EOG_TEXTS}
        else:
            eog = {int(i) for i in eog_ids}
        if eos_id is not None:
            eog.add(eos_id)
        bad = sorted(i for i in eog if not 0 <= i < n)
        if bad:
            raise ValueError(f"eog ids {bad} are outside the vocabulary of {n} tokens")
        self._eog_ids = frozenset(eog)

    # ----------------------------------------------------------------- detection helpers
    @staticmethod
    def _detect_vocab_type(spec: Mapping[str, Any] | None) -> str:
        assert spec is not None
        model = spec.get("model", {})
        text = json.dumps(
            [spec.get("normalizer"), spec.get("pre_tokenizer"), spec.get("decoder")],
            ensure_ascii=False,
        )
        if model.get("type") == "BPE" and not model.get("byte_fallback") and "ByteLevel" in text:
            return "gpt2"
        if model.get("type") in ("BPE", "Unigram") and (
            model.get("byte_fallback") or SPIECE_SPACE in text or "Metaspace" in text
        ):
            return "llama"
        raise ModelFileError(
            f"unsupported tokenizer: model type {model.get('type')!r}; specjax supports "
            "byte-level BPE ('gpt2') and SentencePiece-style BPE/Unigram ('llama')"
        )

    @staticmethod
    def _detect_space_prefix(spec: Mapping[str, Any] | None) -> bool:
        assert spec is not None
        norm = json.dumps(spec.get("normalizer"), ensure_ascii=False)
        if '"Prepend"' in norm and SPIECE_SPACE in norm:
            return True
        pre = spec.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
        for step in steps:
            if step.get("type") == "Metaspace":
                scheme = step.get("prepend_scheme")
                if scheme is None:
                    return bool(step.get("add_prefix_space", True))
                return scheme != "never"
        return False

    # ----------------------------------------------------------------- properties
    @property
    def hf_tokenizer(self) -> tokenizers.Tokenizer:
        return self._tok

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    vocab_type = ReadOnly[str]()
    #: llama.cpp pre-tokenizer name (byte-level BPE only; None when not recognised).
    pre = ReadOnly[str | None]()
    bos_id = ReadOnly[int | None]()
    eos_id = ReadOnly[int | None]()
    pad_id = ReadOnly[int | None]()
    unk_id = ReadOnly[int | None]()
    eog_ids = ReadOnly[frozenset[int]]()
    add_bos = ReadOnly[bool]()
    add_eos = ReadOnly[bool]()
    add_space_prefix = ReadOnly[bool]()

    @property
    def token_types(self) -> tuple[int, ...]:
        return tuple(self._types)

    @property
    def scores(self) -> tuple[float, ...] | None:
        return None if self._scores is None else tuple(self._scores)

    def token_text(self, token_id: int) -> str:
        """The token's vocabulary string, as llama.cpp's `llama_vocab_get_text` returns it."""
        if not 0 <= token_id < len(self._tokens):
            raise ValueError(f"token id {token_id} is outside the vocabulary of {self.vocab_size}")
        return self._tokens[token_id]

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    # ----------------------------------------------------------------- encode / decode
    def encode(self, text: str, add_bos: bool = False, *, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; `add_bos` prepends `bos_id`. `parse_special=False` treats
        special-token strings in `text` as plain text (llama.cpp's `parse_special`)."""
        if add_bos and self._bos_id is None:
            raise ValueError("add_bos=True but this tokenizer has no BOS token")
        previous = self._tok.encode_special_tokens
        self._tok.encode_special_tokens = not parse_special
        try:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        finally:
            self._tok.encode_special_tokens = previous
        bos = self._bos_id
        return [bos, *ids] if add_bos and bos is not None else list(ids)

    def encode_bytes(self, data: bytes, *, parse_special: bool = True) -> list[int]:
        """Token ids of raw bytes that need not be UTF-8 (a prompt file as it is). Runs of
        valid UTF-8 are encoded as text (`encode`); every other byte becomes the byte-level
        BPE token of that byte. Raises ValueError naming the first such byte where the
        vocabulary cannot represent it (a SentencePiece vocabulary reads text only)."""
        text = data.decode("utf-8", errors="surrogateescape")
        if not any("\udc80" <= ch <= "\udcff" for ch in text):
            return self.encode(text, parse_special=parse_special)
        first = next(i for i, ch in enumerate(text) if "\udc80" <= ch <= "\udcff")
        offset = len(text[:first].encode("utf-8"))
        if self._vocab_type != "gpt2":
            raise ValueError(
                f"byte {offset} (0x{ord(text[first]) - 0xDC00:02X}) is not UTF-8, and a "
                f"{self._vocab_type!r} (SentencePiece) vocabulary reads text only"
            )
        ids: list[int] = []
        run: list[str] = []
        for ch in text:
            if "\udc80" <= ch <= "\udcff":
                if run:
                    ids += self.encode("".join(run), parse_special=parse_special)
                    run = []
                byte = ord(ch) - 0xDC00
                tid = self._tok.token_to_id(_BYTE_TO_UNICODE[byte])
                if tid is None:
                    raise ValueError(
                        f"byte 0x{byte:02X} is not UTF-8 and the vocabulary has no token for it"
                    )
                ids.append(int(tid))
            else:
                run.append(ch)
        if run:
            ids += self.encode("".join(run), parse_special=parse_special)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < len(self._tokens)]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary of {self.vocab_size}")
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    # ----------------------------------------------------------------- tokenizer.json I/O
    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a tokenizer.json (or a directory holding one). Special ids and add_bos come
        from sibling tokenizer_config.json / generation_config.json / config.json if present,
        else from the post-processor and token names."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise ModelFileError(f"{path}: tokenizer file not found")
        try:
            with open(path, encoding="utf-8") as f:
                raw = f.read()
            spec = json.loads(raw)
            tok = tokenizers.Tokenizer.from_str(raw)
        except Exception as e:  # tokenizers raises its own Exception type
            raise ModelFileError(f"{path}: not a valid tokenizer.json ({e})") from e
        folder = os.path.dirname(path)
        tcfg = _read_json(os.path.join(folder, "tokenizer_config.json")) or {}
        gcfg = _read_json(os.path.join(folder, "generation_config.json")) or {}
        mcfg = _read_json(os.path.join(folder, "config.json")) or {}

        def lookup(name: str | None) -> int | None:
            return None if name is None else tok.token_to_id(name)

        def as_id_list(value: Any) -> list[int]:
            if value is None:
                return []
            return [int(v) for v in (value if isinstance(value, list) else [value])]

        before, after = _find_template_specials(spec.get("post_processor"))

        def first(*candidates: list[int]) -> int | None:
            return next((c[0] for c in candidates if c), None)

        bos_id = lookup(_token_content(tcfg.get("bos_token")))
        if bos_id is None:
            bos_id = first(
                as_id_list(mcfg.get("bos_token_id")), as_id_list(gcfg.get("bos_token_id"))
            )
        if bos_id is None and before:
            bos_id = lookup(before[0])
        eos_id = lookup(_token_content(tcfg.get("eos_token")))
        gen_eos = as_id_list(gcfg.get("eos_token_id"))
        if eos_id is None:
            eos_id = first(gen_eos, as_id_list(mcfg.get("eos_token_id")))
        if eos_id is None and after:
            eos_id = lookup(after[0])
        pad_id = lookup(_token_content(tcfg.get("pad_token")))
        if pad_id is None and mcfg.get("pad_token_id") is not None:
            pad_id = int(mcfg["pad_token_id"])
        unk_id = lookup(_token_content(tcfg.get("unk_token")))
        if unk_id is None and spec.get("model", {}).get("unk_token"):
            unk_id = lookup(spec["model"]["unk_token"])
        add_bos = tcfg.get("add_bos_token")
        if add_bos is None:
            add_bos = bos_id is not None and bool(before) and lookup(before[0]) == bos_id
        add_eos = tcfg.get("add_eos_token")
        if add_eos is None:
            add_eos = eos_id is not None and bool(after) and lookup(after[-1]) == eos_id

        probe = cls(tok, vocab_type=None)
        eog = {i for i in range(probe.vocab_size) if probe.token_text(i) in EOG_TEXTS}
        eog.update(gen_eos)
        return cls(
            tok,
            bos_id=bos_id,
            eos_id=eos_id,
            pad_id=pad_id,
            unk_id=unk_id,
            eog_ids=eog,
            add_bos=bool(add_bos),
            add_eos=bool(add_eos),
            vocab_type=probe.vocab_type,
            pre=probe.pre,
            add_space_prefix=probe.add_space_prefix,
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write tokenizer.json at `path` (a file, or a directory to hold tokenizer.json).

        When the file is named tokenizer.json, a tokenizer_config.json with the special tokens
        and add_bos/add_eos is written beside it (what `from_file` and transformers read).
        BOS/EOS insertion is also encoded as a TemplateProcessing post-processor."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        tok = tokenizers.Tokenizer.from_str(self._tok.to_str())
        if self._add_bos or self._add_eos:
            single, specials = "$A:0", []
            pair = "$A:0 $B:1"
            if self._add_bos and self._bos_id is not None:
                bos = self._tokens[self._bos_id]
                single, pair = f"{bos}:0 {single}", f"{bos}:0 $A:0 {bos}:1 $B:1"
                specials.append((bos, self._bos_id))
            if self._add_eos and self._eos_id is not None:
                eos = self._tokens[self._eos_id]
                single, pair = f"{single} {eos}:0", f"{pair} {eos}:1"
                if (eos, self._eos_id) not in specials:
                    specials.append((eos, self._eos_id))
            tok.post_processor = processors.TemplateProcessing(
                single=single, pair=pair, special_tokens=specials
            )
        tmp = path + ".tmp"
        tok.save(tmp)
        os.replace(tmp, path)
        if os.path.basename(path) == "tokenizer.json":
            config = self.hf_tokenizer_config()
            cfg_path = os.path.join(os.path.dirname(path) or ".", "tokenizer_config.json")
            with open(cfg_path + ".tmp", "w", encoding="utf-8") as f:
                json.dump(config, f, indent=2, ensure_ascii=False)
            os.replace(cfg_path + ".tmp", cfg_path)

    def hf_tokenizer_config(self) -> dict[str, Any]:
        """tokenizer_config.json contents transformers' PreTrainedTokenizerFast understands."""

        def text(i: int | None) -> str | None:
            return None if i is None else self._tokens[i]

        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": text(self._bos_id),
            "eos_token": text(self._eos_id),
            "pad_token": text(self._pad_id),
            "unk_token": text(self._unk_id),
            "add_bos_token": self._add_bos,
            "add_eos_token": self._add_eos,
            "clean_up_tokenization_spaces": False,
        }

    # ----------------------------------------------------------------- GGUF metadata I/O
    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any], source: str = "GGUF") -> Tokenizer:
        """Build from GGUF `tokenizer.ggml.*` metadata given as plain Python values."""

        def get(key: str, default: Any = None) -> Any:
            return fields.get(f"tokenizer.ggml.{key}", default)

        model = get("model")
        tokens = get("tokens")
        if model is None or tokens is None:
            raise ModelFileError(f"{source}: no tokenizer (tokenizer.ggml.model / .tokens missing)")
        tokens = [str(t) for t in tokens]
        n = len(tokens)
        types = list(get("token_type") or [TOKEN_NORMAL] * n)
        if len(types) < n:
            raise ModelFileError(f"{source}: {len(types)} token types for {n} tokens")
        types = [int(t) for t in types[:n]]

        def special(key: str, default: int | None) -> int | None:
            value = get(key, default)
            if value is None:
                return None
            value = int(value)
            if not 0 <= value < n:  # llama.cpp: out-of-range ids are ignored (set to NULL)
                return None
            return value

        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)

        if model == "gpt2":
            pre = get("pre") or "default"
            family = _PRE_FAMILY.get(pre)
            if family is None:
                raise ModelFileError(
                    f"{source}: unsupported pre-tokenizer tokenizer.ggml.pre={pre!r}; "
                    f"supported: {', '.join(SUPPORTED_PRE)}"
                )
            merges = []
            for line in get("merges") or []:
                pos = line.find(" ", 1)
                if pos < 0:
                    continue
                a, b = line[:pos], line[pos + 1 :]
                if a in vocab and b in vocab and a + b in vocab:
                    merges.append((a, b))
            bpe = models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES_PRE)
            tok = tokenizers.Tokenizer(bpe)
            tok.pre_tokenizer = _pre_tokenizer_for(family)
            tok.decoder = decoders.ByteLevel()
            bos_default = eos_default = None
            add_bos_default = pre in _ADD_BOS_PRE
            add_space_prefix = False
            scores = None
            unk_id = special("unknown_token_id", None)
        elif model == "llama":
            raw_scores = get("scores")
            if raw_scores is None:
                raise ModelFileError(
                    f"{source}: SPM ('llama') tokenizer without tokenizer.ggml.scores"
                )
            if len(raw_scores) < n:
                raise ModelFileError(f"{source}: {len(raw_scores)} scores for {n} tokens")
            scores = [float(s) for s in raw_scores[:n]]
            pre = None
            unk_id = special("unknown_token_id", 0)
            add_space_prefix = bool(get("add_space_prefix", True))
            has_bytes = all(_byte_token(b) in vocab for b in range(256))
            bpe = models.BPE(
                vocab,
                _spm_merges(tokens, scores, types),
                unk_token=None if unk_id is None else tokens[unk_id],
                fuse_unk=True,
                byte_fallback=has_bytes,
            )
            tok = tokenizers.Tokenizer(bpe)
            replace = normalizers.Replace(" ", SPIECE_SPACE)
            tok.normalizer = (
                normalizers.Sequence([normalizers.Prepend(SPIECE_SPACE), replace])
                if add_space_prefix
                else replace
            )
            steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
            if add_space_prefix:
                steps.append(decoders.Strip(" ", 1, 0))
            tok.decoder = decoders.Sequence(steps)
            bos_default, eos_default = 1, 2
            add_bos_default = True
        else:
            raise ModelFileError(
                f"{source}: unsupported tokenizer model tokenizer.ggml.model={model!r}; "
                "supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece)"
            )

        added = []
        for i, (t, ty) in enumerate(zip(tokens, types)):
            if vocab.get(t) != i:
                continue
            if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN):
                added.append(AddedToken(t, special=True, normalized=False))
            elif ty == TOKEN_USER_DEFINED:
                added.append(AddedToken(t, special=False, normalized=False))
        if added:
            tok.add_special_tokens([a for a in added if a.special])
            tok.add_tokens([a for a in added if not a.special])

        bos_id = special("bos_token_id", bos_default)
        eos_id = special("eos_token_id", eos_default)
        eog = {i for i, t in enumerate(tokens) if t in EOG_TEXTS}
        for key in ("eot_token_id", "eom_token_id"):
            value = special(key, None)
            if value is not None:
                eog.add(value)
        return cls(
            tok,
            bos_id=bos_id,
            eos_id=eos_id,
            pad_id=special("padding_token_id", None),
            unk_id=unk_id,
            eog_ids=eog,
            add_bos=bool(get("add_bos_token", add_bos_default)),
            add_eos=bool(get("add_eos_token", False)),
            vocab_type=model,
            pre=pre,
            add_space_prefix=add_space_prefix,
            tokens=tokens,
            token_types=types,
            scores=scores,
        )

    def merges(self) -> list[tuple[str, str]]:
        """BPE merges in rank order (empty for a Unigram model)."""
        model = json.loads(self._tok.to_str())["model"]
        out = []
        for m in model.get("merges", []):
            a, b = m.split(" ", 1) if isinstance(m, str) else m
            out.append((a, b))
        return out

    def gguf_scores(self) -> list[float]:
        """SPM scores: stored ones, else derived (Unigram log-probs, or minus BPE merge rank)."""
        if self._scores is not None:
            return list(self._scores)
        model = json.loads(self._tok.to_str())["model"]
        n = self.vocab_size
        if model.get("type") == "Unigram":
            out = [0.0] * n
            for i, (_, score) in enumerate(model["vocab"]):
                if i < n:
                    out[i] = float(score)
            return out
        # A piece made by merge rank r gets score -r (earlier merge = preferred, as in SPM);
        # multi-character pieces no merge makes get the lowest scores.
        out = [-1e9 - i if len(t) > 1 else 0.0 for i, t in enumerate(self._tokens)]
        index = {t: i for i, t in enumerate(self._tokens)}
        for rank, (a, b) in enumerate(self.merges()):
            j = index.get(a + b)
            if j is not None and out[j] < -1e8:
                out[j] = -float(rank)
        return out

    def write_gguf_metadata(self, writer: Any, n_vocab: int | None = None) -> None:
        """Add `tokenizer.ggml.*` keys to a `gguf.GGUFWriter`; pads to `n_vocab` tokens with
        UNUSED "[PAD{i}]" entries as convert_hf_to_gguf.py does."""
        n_vocab = self.vocab_size if n_vocab is None else n_vocab
        if n_vocab < self.vocab_size:
            raise ValueError(
                f"tokenizer has {self.vocab_size} tokens but the model vocabulary is {n_vocab}"
            )
        pad = n_vocab - self.vocab_size
        tokens = self._tokens + [f"[PAD{i}]" for i in range(self.vocab_size, n_vocab)]
        types = self._types + [TOKEN_UNUSED] * pad
        if self._vocab_type == "gpt2":
            if self._pre is None:
                raise ValueError(
                    "cannot name this byte-level BPE pre-tokenizer for llama.cpp "
                    f"(tokenizer.ggml.pre); recognised pre-tokenizers: {', '.join(SUPPORTED_PRE)}"
                )
            writer.add_tokenizer_model("gpt2")
            writer.add_tokenizer_pre(self._pre)
            writer.add_token_list(tokens)
            writer.add_token_types(types)
            writer.add_token_merges([f"{a} {b}" for a, b in self.merges()])
        else:
            writer.add_tokenizer_model("llama")
            writer.add_tokenizer_pre("default")
            writer.add_token_list(tokens)
            writer.add_token_scores(self.gguf_scores() + [-1e9] * pad)
            writer.add_token_types(types)
            writer.add_add_space_prefix(self._add_space_prefix)
        if self._bos_id is not None:
            writer.add_bos_token_id(self._bos_id)
        if self._eos_id is not None:
            writer.add_eos_token_id(self._eos_id)
        if self._pad_id is not None:
            writer.add_pad_token_id(self._pad_id)
        if self._unk_id is not None:
            writer.add_unk_token_id(self._unk_id)
        # llama.cpp derives EOG from eos/eot/eom and token names; name one extra id as eot.
        derived = {i for i, t in enumerate(self._tokens) if t in EOG_TEXTS}
        if self._eos_id is not None:
            derived.add(self._eos_id)
        extra = sorted(self._eog_ids - derived)
        if extra:
            writer.add_eot_token_id(extra[0])
        writer.add_add_bos_token(self._add_bos)
        writer.add_add_eos_token(self._add_eos)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_type={self._vocab_type!r}, pre={self._pre!r}, "
            f"vocab_size={self.vocab_size}, bos_id={self._bos_id}, eos_id={self._eos_id})"
        )
