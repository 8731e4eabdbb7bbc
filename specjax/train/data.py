"""Training corpus: CPython standard-library sources, a byte-level BPE tokenizer, token arrays.

Corpus:
* Every ``.py`` file under the running interpreter's stdlib (``sysconfig.get_paths()["stdlib"]``),
  excluding ``site-packages``, sorted by relative POSIX path, read as bytes and decoded as UTF-8
  with ``errors="replace"``.
* Split by whole files: file ``i`` (0-based, in sorted order) goes to validation when
  ``(i + 1) % every == 0`` (every 50th file), all others to train.

Token arrays: one flat ``uint16`` array per split; each file is encoded as
``[BOS] + ids + [EOS]``. Arrays are cached as ``.npy`` under ``cache_dir/<key>/`` where ``key``
hashes the file list (relative paths and sizes) and the tokenizer JSON. A training run may
instead point at a pre-tokenized ``.npy`` (``data.tokens_path``), e.g. on a machine whose Python
ships a different stdlib.

Command line (also reachable from ``specjax train``'s wiring)::

    python -m specjax.train.data tokenizer --config configs/train/tokenizer.yaml
    python -m specjax.train.data tokenize  --tokenizer models/tokenizer/tokenizer.json --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import sysconfig
import time
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from specjax.pytree import check_known_keys

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (BOS, EOS, PAD)  # ids 0, 1, 2
VALIDATION_EVERY = 50


# ---------------------------------------------------------------------------------------------
# Corpus files


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | str | None = None) -> list[str]:
    """Sorted relative POSIX paths of every ``.py`` file under ``root``, without site-packages."""
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if "site-packages" in rel.parts or "dist-packages" in rel.parts:
            continue
        if not path.is_file():
            continue
        out.append(rel.as_posix())
    return sorted(out)


def split_files(files: Sequence[str], every: int = VALIDATION_EVERY) -> tuple[list[str], list[str]]:
    """Deterministic split by whole files: every ``every``-th file (of the sorted list) -> val."""
    if every < 2:
        raise ValueError(f"validation split needs every >= 2, got {every}")
    ordered = sorted(files)
    train = [f for i, f in enumerate(ordered) if (i + 1) % every]
    val = [f for i, f in enumerate(ordered) if (i + 1) % every == 0]
    return train, val


def read_text(path: Path | str) -> str:
    """A source file's text: UTF-8 with undecodable bytes replaced by U+FFFD."""
    return Path(path).read_bytes().decode("utf-8", errors="replace")


def read_texts(files: Sequence[str], root: Path | str | None = None) -> list[str]:
    root = Path(root) if root is not None else stdlib_root()
    return [read_text(root / f) for f in files]


def file_list_hash(files: Sequence[str], root: Path | str | None = None) -> str:
    """Hash of relative paths and byte sizes (cheap, changes when the stdlib changes)."""
    root = Path(root) if root is not None else stdlib_root()
    h = hashlib.sha256()
    for f in files:
        h.update(f.encode())
        h.update(b"\0")
        h.update(str((root / f).stat().st_size).encode())
        h.update(b"\n")
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizerConfig:
    """Recipe of the byte-level BPE tokenizer (configs/train/tokenizer.yaml)."""

    vocab_size: int = 2048
    min_frequency: int = 2
    validation_every: int = VALIDATION_EVERY
    output: str = "models/tokenizer/tokenizer.json"
    stdlib: str | None = None  # None -> the running interpreter's stdlib

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TokenizerConfig:
        check_known_keys(cls, data, "unknown tokenizer config keys")
        return cls(**data)


def build_tokenizer_from_texts(
    texts: Sequence[str], vocab_size: int, min_frequency: int = 2
) -> Any:
    """Train a GPT-2 style byte-level BPE (`tokenizers.Tokenizer`) on `texts`.

    Specials ``<s>``, ``</s>``, ``<pad>`` get ids 0, 1, 2. The pre-tokenizer is the plain
    GPT-2 byte-level regex (llama.cpp pre-tokenizer "gpt-2"); no normalizer, no prefix space.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:
            raise RuntimeError(f"special token {s!r} did not land at id {i}")
    return tok


def train_tokenizer(config: TokenizerConfig | dict[str, Any]) -> Any:
    """Train the tokenizer on the train split of the stdlib corpus and save it to config.output."""
    if isinstance(config, dict):
        config = TokenizerConfig.from_dict(config)
    files = stdlib_files(config.stdlib)
    train, _ = split_files(files, config.validation_every)
    texts = read_texts(train, config.stdlib)
    tok = build_tokenizer_from_texts(texts, config.vocab_size, config.min_frequency)
    out = Path(config.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    write_tokenizer_config(out.parent)
    return tok


def write_tokenizer_config(folder: Path | str, model_max_length: int = 512) -> None:
    """tokenizer_config.json beside tokenizer.json: special tokens and add_bos (the models are
    trained on ``[BOS] + text + [EOS]`` documents, so prompts start with BOS)."""
    cfg = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def load_tokenizer(path: Path | str) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode table (the byte-level alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """Raw bytes a token stands for (b"" for special tokens)."""
    piece = tokenizer.id_to_token(token_id)
    if piece is None or piece in SPECIAL_TOKENS:
        return b""
    table = _unicode_to_byte()
    return bytes(table[c] for c in piece)


def token_byte_lengths(tokenizer: Any) -> np.ndarray:
    """[V] int64: number of UTF-8 bytes each token id decodes to (specials: 0)."""
    V = tokenizer.get_vocab_size()
    return np.array([len(token_bytes(tokenizer, i)) for i in range(V)], np.int64)


def encode_documents(tokenizer: Any, texts: Sequence[str]) -> np.ndarray:
    """Flat uint16 array: for each text ``[BOS] + ids + [EOS]``."""
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    if tokenizer.get_vocab_size() > 65535:
        raise ValueError("uint16 token arrays need a vocabulary below 65536")
    parts = []
    for enc in tokenizer.encode_batch(list(texts), add_special_tokens=False):
        parts.append(np.asarray([bos, *enc.ids, eos], np.uint16))
    return np.concatenate(parts) if parts else np.zeros((0,), np.uint16)


# ---------------------------------------------------------------------------------------------
# Cached token arrays


def cache_key(files: Sequence[str], tokenizer_path: Path | str, root: Path | str | None) -> str:
    h = hashlib.sha256()
    h.update(file_list_hash(files, root).encode())
    h.update(hashlib.sha256(Path(tokenizer_path).read_bytes()).hexdigest().encode())
    return h.hexdigest()[:16]


def build_token_arrays(
    tokenizer_path: Path | str,
    cache_dir: Path | str = "runs/data",
    *,
    stdlib: Path | str | None = None,
    every: int = VALIDATION_EVERY,
) -> dict[str, Path]:
    """Tokenize the stdlib train/validation splits (cached); returns {"train": npy, "val": npy}."""
    files = stdlib_files(stdlib)
    key = cache_key(files, tokenizer_path, stdlib)
    out = Path(cache_dir) / key
    paths = {"train": out / "train.npy", "val": out / "val.npy"}
    if all(p.exists() for p in paths.values()) and (out / "meta.json").exists():
        return paths
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(tokenizer_path)
    train, val = split_files(files, every)
    meta: dict[str, Any] = {
        "stdlib": str(Path(stdlib) if stdlib is not None else stdlib_root()),
        "python": sys.version.split()[0],
        "tokenizer_sha256": hashlib.sha256(Path(tokenizer_path).read_bytes()).hexdigest(),
        "validation_every": every,
    }
    for name, split in (("train", train), ("val", val)):
        texts = read_texts(split, stdlib)
        tokens = encode_documents(tok, texts)
        tmp = paths[name].with_suffix(".tmp.npy")
        np.save(tmp, tokens)
        tmp.replace(paths[name])
        meta[name] = {
            "files": list(split),
            "n_files": len(split),
            "n_bytes": sum(len(t.encode("utf-8")) for t in texts),
            "n_tokens": int(tokens.size),
        }
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return paths


# ---------------------------------------------------------------------------------------------
# Command line


def data_main(argv: Sequence[str] | None = None) -> int:
    """`python -m specjax.train.data {tokenizer,tokenize,compare}`."""
    p = argparse.ArgumentParser(prog="specjax.train.data", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokenizer", help="train the BPE tokenizer from a recipe YAML")
    t.add_argument("--config", default="configs/train/tokenizer.yaml")
    t.add_argument("--vocab-size", type=int, default=None, help="override vocab_size")
    t.add_argument("--output", default=None, help="override output path")
    k = sub.add_parser("tokenize", help="tokenize the stdlib splits; copy train/val .npy to --out")
    k.add_argument("--tokenizer", default="models/tokenizer/tokenizer.json")
    k.add_argument("--cache-dir", default="runs/data")
    k.add_argument("--out", default=None, help="also copy train.npy/val.npy/meta.json here")
    args = p.parse_args(argv)

    if args.cmd == "tokenizer":
        cfg = yaml.safe_load(Path(args.config).read_text()) or {}
        if args.vocab_size is not None:
            cfg["vocab_size"] = args.vocab_size
        if args.output is not None:
            cfg["output"] = args.output
        t0 = time.perf_counter()
        config = TokenizerConfig.from_dict(cfg)
        tok = train_tokenizer(config)
        files = stdlib_files(config.stdlib)
        _, val = split_files(files, config.validation_every)
        texts = read_texts(val, config.stdlib)
        n_bytes = sum(len(x.encode("utf-8")) for x in texts)
        n_tok = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
        print(
            json.dumps(
                {
                    "output": config.output,
                    "vocab_size": tok.get_vocab_size(),
                    "val_bytes": n_bytes,
                    "val_tokens": n_tok,
                    "bytes_per_token": n_bytes / max(n_tok, 1),
                    "seconds": round(time.perf_counter() - t0, 1),
                }
            )
        )
    elif args.cmd == "tokenize":
        paths = build_token_arrays(args.tokenizer, args.cache_dir)
        if args.out:
            import shutil

            dst = Path(args.out)
            dst.mkdir(parents=True, exist_ok=True)
            for name, src in paths.items():
                shutil.copyfile(src, dst / f"{name}.npy")
            shutil.copyfile(paths["train"].parent / "meta.json", dst / "meta.json")
        meta = json.loads((paths["train"].parent / "meta.json").read_text())
        print(json.dumps({k: str(v) for k, v in paths.items()}))
        for name in ("train", "val"):
            m = meta[name]
            print(f"{name}: {m['n_files']} files, {m['n_bytes']} bytes, {m['n_tokens']} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(data_main())
