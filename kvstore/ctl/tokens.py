"""Token ids for ``kvctl lookup``/``pin``: given as numbers, read from a file, or made from text
with a tokenizer that is already on this machine (nothing is ever downloaded)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from kvstore.errors import UsageError

Tokenize = Callable[[str], list[int]]


def parse_ids(text: str, where: str = "token ids") -> list[int]:
    """Ids from a JSON list (``[1, 2, 3]``) or numbers separated by commas or whitespace."""
    text = text.strip()
    if text.startswith("["):
        try:
            ids = json.loads(text)
        except ValueError as e:
            raise UsageError(f"{where}: not a JSON list of integers ({e})") from e
    else:
        ids = text.replace(",", " ").split()
    try:
        return [int(x) for x in ids]
    except (TypeError, ValueError) as e:
        raise UsageError(f"{where}: expected integers, got {e}") from e


def _hf_offline() -> None:
    # A tokenizer name must never reach the network: only files on this machine.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def load_tokenizer(spec: str, special_tokens: bool = True) -> Tokenize:
    """``spec``: ``bytes`` (UTF-8 bytes as ids: a fallback that needs nothing), a
    ``tokenizer.json`` file (the ``tokenizers`` library), or a directory or model id of a
    Hugging Face tokenizer already on this machine (``transformers``, offline)."""
    if spec == "bytes":
        return lambda text: list(text.encode())
    path = Path(spec).expanduser()
    looks_like_path = spec.endswith(".json") or spec.startswith(("./", "../", "/", "~")) or os.sep + os.sep in spec
    if looks_like_path and not path.exists():
        raise UsageError(
            f"--tokenizer {spec}: no such file or directory ({path.absolute()}); pass an existing "
            "tokenizer.json or tokenizer directory, or --tokenizer bytes"
        )
    if path.is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise UsageError(f"--tokenizer {spec}: reading tokenizer.json needs `pip install tokenizers`") from e
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises bare Exception on a malformed file
            raise UsageError(f"--tokenizer {spec}: not a tokenizer.json ({e})") from e
        return lambda text: tok.encode(text, add_special_tokens=special_tokens).ids
    _hf_offline()
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise UsageError(
            f"--tokenizer {spec}: a Hugging Face tokenizer needs `pip install transformers`; "
            "or pass a tokenizer.json file, or --tokenizer bytes"
        ) from e
    try:
        hf = AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError) as e:
        raise UsageError(
            f"--tokenizer {spec}: no such tokenizer on this machine ({str(e).splitlines()[0]}); pass a "
            "local directory or tokenizer.json (kvctl never downloads), or --tokenizer bytes"
        ) from e
    return lambda text: list(hf.encode(text, add_special_tokens=special_tokens))
