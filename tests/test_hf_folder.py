"""Importing a local Hugging Face folder gives the same model as importing the GGUF."""

from __future__ import annotations

import json

import pytest

from edgepipe.model.importer import import_model
from edgepipe.model.package import Package
from edgepipe.model.store import bundled_gguf
from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams

torch = pytest.importorskip("torch", reason="building the HF folder needs torch (test extra)")
transformers = pytest.importorskip("transformers")

# 40 s (a safetensors checkpoint written with torch, then imported): kept out of the default run
# to hold it near 10 minutes on 2 cores; `pytest -m slow` runs it.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A safetensors checkpoint written by transformers from the bundled GGUF's weights."""
    path = bundled_gguf()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    config = loaded.config
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    folder = tmp_path_factory.mktemp("hf") / "smollm2-hf"
    plain.save_pretrained(folder, safe_serialization=True)
    transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_hf_folder_import_matches_gguf(hf_folder, fp32_pkg, tmp_path):
    pkg = Package(import_model(hf_folder, tmp_path / "models", "fp32", measure_cost=False))
    assert pkg.manifest.config["rope_interleaved"] is False and pkg.manifest.config["tie_embeddings"] is True
    tok = pkg.tokenizer
    ids = tok.encode(tok.format_chat([{"role": "user", "content": "Name three rivers."}]))
    assert ids == fp32_pkg.tokenizer.encode(fp32_pkg.tokenizer.format_chat([{"role": "user", "content": "Name three rivers."}]))
    params = GenerationParams(max_tokens=32)
    ours = generate(pkg.pipeline([10]), ids, params, tok.decode, eos_ids=()).tokens
    reference = generate(fp32_pkg.pipeline(), ids, params, tok.decode, eos_ids=()).tokens
    assert ours == reference
    assert 2 in pkg.manifest.eos_ids  # <|im_end|> from the folder's tokenizer files


def test_folder_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="no .safetensors"):
        import_model(tmp_path, tmp_path / "models", "int4")
