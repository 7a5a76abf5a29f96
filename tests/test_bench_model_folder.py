"""``bench model-folder``: a preset folder whose tokenizer covers the vocabulary, so a server with
dummy weights streams text for every id it samples."""

import json

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
