"""The bundled corpus: the running Python's standard library, split train / held-out,
shared by the demo trainer, int4 calibration and `eval_ppl`
(docs/quantization.md#perplexity-eval_ppl).
"""

from __future__ import annotations

import os
import pathlib
import sysconfig
import zlib

HELD_OUT_EVERY = 20
MAX_FILE_BYTES = 500_000


def stdlib_root() -> pathlib.Path:
    """Where this interpreter's standard library lives, or $JAXINFER_CORPUS_DIR: another
    Python's library carried to a machine (a lent GPU's Python is not 3.11.7, and the
    split and the demo models' training follow 3.11.7's files)."""
    return pathlib.Path(os.environ.get("JAXINFER_CORPUS_DIR")
                        or sysconfig.get_paths()["stdlib"])


def corpus_files(root: pathlib.Path | str | None = None
                 ) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    """(train, held-out) .py files under `root` (default: the standard library),
    sorted, split by a hash of the relative path; site-packages excluded."""
    root = pathlib.Path(root) if root else stdlib_root()
    files = sorted(p for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and p.stat().st_size < MAX_FILE_BYTES)
    held = [p for p in files if is_held_out(p.relative_to(root))]
    held_set = set(held)
    return [p for p in files if p not in held_set], held


def is_held_out(relative_path: pathlib.Path | str) -> bool:
    """Whether a file (path relative to the library root) was held out of training."""
    return zlib.crc32(str(relative_path).encode()) % HELD_OUT_EVERY == 0


def read_texts(files: list[pathlib.Path]) -> list[str]:
    """Each file's text (undecodable bytes replaced)."""
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]
