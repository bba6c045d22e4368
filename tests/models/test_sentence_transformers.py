"""sentence-transformers folders, saved by the ``sentence-transformers`` package itself over a small BERT,
embed as its ``encode`` does (within 1e-5): each pooling mode, the ``Normalize`` module, ``max_seq_length``
truncation and ``do_lower_case``, in the package's current format and in the older one most downloaded
folders hold. What jitserve does not do (another module, several pooling modes, a default prompt) is
refused by name. Served mean-pooled and unnormalised before, an all-MiniLM-style folder gave vectors of norm
~7.8 instead of 1, and a bge-style (CLS) one the wrong vector."""

from __future__ import annotations

import json

import numpy as np
import pytest
from checkpoints import CORPUS, bert
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

import jitserve as js

TEXTS = ["good", "Once Upon A Time there was a little model.", " ".join(CORPUS[:2]), "Café, naïve: 東京"]
LEGACY = {"Transformer": "sentence_transformers.models.Transformer", "Pooling": "sentence_transformers.models.Pooling",
          "Normalize": "sentence_transformers.models.Normalize"}


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    return bert(tmp_path_factory.mktemp("bert") / "encoder", "embedding", seed=1)


def saved(encoder, folder, pooling, normalize=True, max_seq_length=32):
    transformer = Transformer(str(encoder), max_seq_length=max_seq_length)
    pool = Pooling(transformer.get_embedding_dimension(), pooling)
    SentenceTransformer(modules=[transformer, pool, *([Normalize()] if normalize else [])],
                        device="cpu").save(str(folder))
    return folder


def edit(folder, name, change):
    path = folder / name
    data = json.loads(path.read_text()) if path.exists() else {}
    data = change(data) or data
    path.write_text(json.dumps(data))


def expect_equal(folder):
    reference = SentenceTransformer(str(folder), device="cpu").encode(TEXTS)
    got = js.from_pretrained(folder).run(TEXTS)["embedding"]
    np.testing.assert_allclose(got, reference, atol=1e-5)
    return got


@pytest.mark.parametrize(("pooling", "normalize"), [("mean", True), ("cls", True), ("lasttoken", False),
                                                    ("max", False), ("mean_sqrt_len_tokens", False),
                                                    ("weightedmean", True)])
def test_each_pooling_mode_and_normalize_equal_sentence_transformers(encoder, tmp_path, pooling, normalize):
    got = expect_equal(saved(encoder, tmp_path / pooling, pooling, normalize))
    norms = np.linalg.norm(got, axis=-1)
    assert np.allclose(norms, 1, atol=1e-5) if normalize else not np.allclose(norms, 1, atol=0.1)


def test_texts_past_max_seq_length_are_cut_as_sentence_transformers_cuts_them(encoder, tmp_path):
    folder = saved(encoder, tmp_path / "short", "mean", max_seq_length=12)
    whole = js.from_pretrained(encoder, pooling="mean", normalize=True).run(TEXTS)["embedding"]
    cut = expect_equal(folder)
    assert not np.allclose(cut[2], whole[2], atol=1e-3), "the long text is embedded whole"
    np.testing.assert_allclose(cut[0], whole[0], atol=1e-5)
    assert js.from_pretrained(folder).run([" ".join(CORPUS)])["embedding"].shape == (1, 64)


def test_the_older_format_and_do_lower_case_equal_sentence_transformers(encoder, tmp_path):
    """Folders written before sentence-transformers 5: module types under ``sentence_transformers.models``,
    one flag per pooling mode, ``max_seq_length`` and ``do_lower_case`` in ``sentence_bert_config.json``;
    the tokenizer here does not lower-case by itself, so ``do_lower_case`` shows."""
    folder = saved(encoder, tmp_path / "legacy", "cls", max_seq_length=64)
    edit(folder, "modules.json", lambda modules: [{**m, "type": LEGACY[m["type"].rsplit(".", 1)[-1]]}
                                                  for m in modules])
    edit(folder, "1_Pooling/config.json", lambda c: {"word_embedding_dimension": 64, "pooling_mode_cls_token": True,
                                                     "pooling_mode_mean_tokens": False})
    edit(folder, "sentence_bert_config.json", lambda c: {"max_seq_length": 16, "do_lower_case": True})
    edit(folder, "tokenizer.json", lambda t: t["normalizer"].update(lowercase=False))
    expect_equal(folder)


@pytest.mark.parametrize(("name", "change", "message"), [
    ("modules.json", lambda m: [*m, {"idx": 3, "name": "3", "path": "3_Dense",
                                     "type": "sentence_transformers.models.Dense"}],
     r"modules.json lists .*Normalize, sentence_transformers.models.Dense; jitserve serves a sentence-transformers "
     r"Transformer, its Pooling and optionally Normalize"),
    ("1_Pooling/config.json", lambda c: c.update(pooling_mode=["cls", "mean"]),
     r"1_Pooling/config.json pools by \['cls', 'mean'\]; jitserve pools by one mode of mean, cls"),
    ("config_sentence_transformers.json", lambda c: c.update(default_prompt_name="query"),
     r"'default_prompt_name' is 'query'; jitserve does not put a prompt before the texts"),
    ("sentence_bert_config.json", lambda c: c.update(max_seq_length=512),
     r"'max_seq_length' is 512; expected a positive integer at most the model's context \(128\)"),
])
def test_what_jitserve_does_not_do_is_refused_by_name(encoder, tmp_path, name, change, message):
    folder = saved(encoder, tmp_path / "refused", "cls")
    edit(folder, name, change)
    with pytest.raises(js.CheckpointError, match=message):
        js.from_pretrained(folder)


def test_options_given_win_over_the_folder(encoder, tmp_path):
    folder = saved(encoder, tmp_path / "chosen", "cls")
    got = js.from_pretrained(folder, pooling="mean", normalize=False).run(TEXTS[:1])["embedding"]
    reference = js.from_pretrained(encoder).run(TEXTS[:1])["embedding"]
    np.testing.assert_allclose(got, reference, atol=1e-6)
