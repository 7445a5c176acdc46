"""Converted weights: a .gguf model's dequantized weights kept as safetensors, so that later loads
skip transformers' GGUF parse (about 15 s for the packaged SmolLM2-135M and 45 s for Gemma 3 270M
on 2 CPU cores, 0.2 s from the converted copy).

A copy lives in `<directory>/<gguf stem>-<dtype>-<key>/`, where `key` hashes the .gguf file's bytes
and the transformers version that converted it, so an edited file or another converter never meets
an old copy. A copy is written in a temporary directory, its manifest last, and renamed into place
whole: a reader sees a complete copy or none. It is used only if its manifest matches and the
weights it loads have the fingerprint recorded at conversion (`loading.load` checks); otherwise it
is removed, the .gguf file is converted again and a warning says so. A copy that cannot be written
(a full disk, a cache directory that cannot be created, weights the saver refuses) costs the next
load its speed, never this load its model: a warning says so.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fusionrag_core.runtime import compat

log = logging.getLogger(__name__)

MANIFEST = "fusionrag-converted.json"
_FORMAT = 1  # NOTE: bump when what a copy holds changes; older copies are then never read
_ABANDONED_AFTER_S = 3600.0


@dataclass(frozen=True)
class ConvertedCache:
    """Where converted .gguf weights are kept (see the module doc).

    Attributes:
        directory: None for `$XDG_CACHE_HOME/fusionrag/converted` (`~/.cache/fusionrag/converted`
            when XDG_CACHE_HOME is unset), as other model caches on the machine.
    """

    directory: Path | None = None

    def root(self) -> Path:
        if self.directory is not None:
            return Path(self.directory)
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base) / "fusionrag" / "converted"

    def slot(self, gguf: Path, dtype: torch.dtype) -> Path:
        """Where the copy of `gguf` loaded as `dtype` lives (present or not)."""
        return self.root() / f"{gguf.stem}-{str(dtype).removeprefix('torch.')}-{_key(gguf)}"


DEFAULT_CONVERTED = ConvertedCache()


def _key(gguf: Path) -> str:
    digest = hashlib.sha256(f"{_FORMAT}:{transformers.__version__}:".encode())
    with gguf.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()[:24]


def read(slot: Path, dtype: torch.dtype, device: torch.device
         ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str] | None:
    """The copy at `slot` and the fingerprint its weights had when converted; None when there is no
    complete copy. A copy that fails to load is removed (with a warning) and reads as none."""
    manifest = slot / MANIFEST
    if not manifest.is_file():
        return None
    try:
        recorded = json.loads(manifest.read_text(encoding="utf-8"))["fingerprint"]
        model, tokenizer = compat.load_model(slot, gguf_file=None, dtype=dtype, device=device)
    except Exception as exc:  # NOTE: any damage (truncated safetensors, bad JSON) means convert again
        discard(slot, f"it failed to load ({exc.__class__.__name__}: {exc})")
        return None
    return model, tokenizer, str(recorded)


def write(slot: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, fingerprint: str) -> None:
    """Keep `model` (just converted from a .gguf file) and `tokenizer` at `slot`; best effort."""
    temporary = slot.parent / f".{slot.name}.{uuid.uuid4().hex}.tmp"
    _remove_abandoned(slot)
    try:
        temporary.mkdir(parents=True)
        compat.save_dequantized(model, tokenizer, temporary)
        (temporary / MANIFEST).write_text(json.dumps({"fingerprint": fingerprint, "format": _FORMAT}),
                                          encoding="utf-8")
        os.rename(temporary, slot)
    except Exception as exc:  # NOTE: a disk error or a model the saver refuses: never this load's model
        shutil.rmtree(temporary, ignore_errors=True)
        if (slot / MANIFEST).is_file():
            return  # NOTE: another process kept the same copy first
        log.warning("could not keep the converted weights in %s (%s: %s); the next load converts the .gguf "
                    "file again", slot, exc.__class__.__name__, exc)


def _remove_abandoned(slot: Path) -> None:
    """Remove temporary copies of `slot` that a killed process left (none is written for that long)."""
    for abandoned in slot.parent.glob(f".{slot.name}.*.tmp"):
        with contextlib.suppress(OSError):
            if time.time() - abandoned.stat().st_mtime > _ABANDONED_AFTER_S:
                shutil.rmtree(abandoned, ignore_errors=True)


def discard(slot: Path, why: str) -> None:
    """Remove the copy at `slot`, saying why: the .gguf file is converted again."""
    log.warning("the converted weights in %s are not used: %s; converting the .gguf file again", slot, why)
    shutil.rmtree(slot, ignore_errors=True)


__all__ = ["DEFAULT_CONVERTED", "MANIFEST", "ConvertedCache", "discard", "read", "write"]
