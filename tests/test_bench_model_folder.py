"""``bench model-folder``: a preset folder whose tokenizer covers the vocabulary, so a server with
dummy weights streams text for every id it samples."""

import json
import os
import subprocess
import sys
from pathlib import Path

from breakgraph.cli import main


def test_model_folder_tokenizer_covers_the_preset_vocabulary(tmp_path):
    from transformers import AutoTokenizer

    from breakgraph.bench.presets import PRESETS
    from breakgraph.models.config import ModelConfig

    out = tmp_path / "m"
    assert main(["bench", "model-folder", "--preset", "glm5-tp8-rank-4l-bf16", "--out", str(out)]) == 0
    vocab = PRESETS["glm5-tp8-rank-4l-bf16"]["vocab_size"]
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == vocab
    assert all(tok.decode([i]) != "" for i in range(vocab)), "an id decodes to no text"
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == tok.eos_token_id and config["vocab_size"] == vocab
    cfg = ModelConfig.from_dict(config)
    assert cfg.num_hidden_layers == 4 and cfg.vocab_size == vocab
    text = "Natalia sold clips to 48 of her friends in April."
    assert tok.decode(tok(text).input_ids) == text


def test_preset_folder_without_root_is_removed_when_the_process_exits(tmp_path):
    """A bench run writes its preset's config.json to a temp dir; none is left behind after it."""
    code = "from breakgraph.bench.presets import preset_folder; f = preset_folder('glm5-tp8-rank'); print(f)"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    folder = Path(out.strip())
    assert folder.parent == tmp_path and folder.name.startswith("breakgraph-glm5-tp8-rank-")
    assert not folder.exists()
    assert list(tmp_path.iterdir()) == []
