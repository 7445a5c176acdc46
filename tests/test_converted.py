"""A .gguf model's converted copy loads the same model, and a damaged or unwritable copy never costs
a load its model (`runtime.converted`)."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from fusionrag_core.engine import FusionEngine
from fusionrag_core.runtime import compat, converted, loading
from fusionrag_core.runtime.converted import MANIFEST, ConvertedCache

PROMPT = ("Who designed the lighthouse?",
          ["The Lumen lighthouse was designed by Ada Vell.", "Ada Vell was born in Marrow."])
TEXT = "<|im_start|>user\nHéllo wörld, 123 <tag> 🙂<|im_end|>"


def _gguf_loads(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """The `gguf_file` of every `compat.load_model` call (None: a converted copy or a directory)."""
    calls: list[str | None] = []
    load_model = compat.load_model

    def recording(source: str | Path, **kwargs: object) -> object:
        calls.append(kwargs["gguf_file"])  # type: ignore[arg-type]
        return load_model(source, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(compat, "load_model", recording)
    return calls


def _slots(root: Path) -> list[Path]:
    return sorted(root.iterdir()) if root.exists() else []


@pytest.mark.slow
def test_a_converted_copy_loads_the_same_model_and_a_copy_with_other_weights_is_converted_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    cache = ConvertedCache(tmp_path / "converted")
    loads = _gguf_loads(monkeypatch)
    fresh = FusionEngine.from_pretrained(device="cpu", dtype=torch.float32, converted_weights=cache)
    (slot,) = _slots(cache.root())  # complete, and no temporary directory left beside it
    assert (slot / MANIFEST).is_file() and "float32" in slot.name

    kept = FusionEngine.from_pretrained(device="cpu", dtype=torch.float32, converted_weights=cache)
    assert loads == ["SmolLM2-135M-Instruct.Q4_1.gguf", None]  # the second load read the copy
    assert kept.fingerprint == fresh.fingerprint and kept.eos_ids == fresh.eos_ids
    assert kept.tokenizer(TEXT).input_ids == fresh.tokenizer(TEXT).input_ids
    assert kept.tokenizer.chat_template == fresh.tokenizer.chat_template
    prompt = fresh.prompt(PROMPT[0], chunks=PROMPT[1])
    want, got = fresh.generate(prompt), kept.generate(kept.prompt(PROMPT[0], chunks=PROMPT[1]))
    assert got.text == want.text and torch.equal(got.first_token_logits, want.first_token_logits)

    # a copy whose weights are not the ones recorded at conversion is removed and converted again
    manifest = json.loads((slot / MANIFEST).read_text())
    (slot / MANIFEST).write_text(json.dumps({**manifest, "fingerprint": "0" * 32}))
    with caplog.at_level(logging.WARNING, logger=converted.__name__):
        again = FusionEngine.from_pretrained(device="cpu", dtype=torch.float32, converted_weights=cache)
    assert loads[2:] == [None, "SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert "weights differ" in caplog.text and again.fingerprint == fresh.fingerprint
    assert json.loads((slot / MANIFEST).read_text())["fingerprint"] == fresh.fingerprint
    assert _slots(cache.root()) == [slot]


def test_a_truncated_copy_reads_as_none_and_is_removed(default_engine: FusionEngine, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    slot = tmp_path / "copy"
    converted.write(slot, default_engine.model, default_engine.tokenizer, default_engine.fingerprint)
    model, _, recorded = converted.read(slot, torch.float32, torch.device("cpu")) or pytest.fail("no copy")
    assert recorded == default_engine.fingerprint == loading.fingerprint(model)
    weights = slot / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger=converted.__name__):
        assert converted.read(slot, torch.float32, torch.device("cpu")) is None
    assert "failed to load" in caplog.text and not slot.exists()


def test_a_copy_that_cannot_be_written_is_reported_and_leaves_nothing(
        default_engine: FusionEngine, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")  # NOTE: a real failure: nothing can be created under a file
    slot = blocker / "copy"
    with caplog.at_level(logging.WARNING, logger=converted.__name__):
        converted.write(slot, default_engine.model, default_engine.tokenizer, default_engine.fingerprint)
    assert "could not keep the converted weights" in caplog.text
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]
    assert converted.read(slot, torch.float32, torch.device("cpu")) is None


def test_the_default_directory_follows_xdg_cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert ConvertedCache().root() == tmp_path / "fusionrag" / "converted"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert ConvertedCache().root() == Path.home() / ".cache" / "fusionrag" / "converted"
    assert ConvertedCache(tmp_path / "x").root() == tmp_path / "x"


def test_a_write_removes_temporary_copies_a_killed_process_left(default_engine: FusionEngine, tmp_path: Path) -> None:
    slot = tmp_path / "copy"
    abandoned, current = tmp_path / ".copy.dead.tmp", tmp_path / ".copy.writing.tmp"
    for temporary in (abandoned, current):
        temporary.mkdir()
        (temporary / "model.safetensors").write_bytes(b"partial")
    os.utime(abandoned, (time.time() - 2 * 3600, time.time() - 2 * 3600))
    converted.write(slot, default_engine.model, default_engine.tokenizer, default_engine.fingerprint)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".copy.writing.tmp", "copy"]


def test_a_model_the_saver_refuses_is_reported_and_leaves_nothing(tokenizer: PreTrainedTokenizerBase,
                                                                   tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """safetensors refuses weights that are partial views of one storage (a RuntimeError, not an
    OSError): the load that converted the model keeps it, as for a full disk."""
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))
    shared = torch.zeros(64, 32)
    model.model.embed_tokens.weight = torch.nn.Parameter(shared[:, :16])
    model.lm_head.weight = torch.nn.Parameter(shared[:, 16:])
    with caplog.at_level(logging.WARNING, logger=converted.__name__):
        converted.write(tmp_path / "copy", model, tokenizer, "0" * 32)
    assert "could not keep the converted weights" in caplog.text and "RuntimeError" in caplog.text
    assert list(tmp_path.iterdir()) == []
