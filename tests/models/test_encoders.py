"""BERT checkpoints as text servings: the labels and probabilities of ``BertForSequenceClassification``
and the mean-pooled vectors of ``BertModel`` equal ``transformers``', for texts up to the model's context
(padded to compiled lengths, never cut), alone and batched with others."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import torch
from checkpoints import CORPUS, bert
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

import jitserve as js

TEXTS = ["good", "Once upon a time there was a little model.", " ".join(CORPUS[:2]), " ".join(CORPUS[:5])]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return bert(tmp_path_factory.mktemp("bert") / "classifier", "classification")


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    return bert(tmp_path_factory.mktemp("bert") / "encoder", "embedding", seed=1)


def hidden_states(model, tokenizer, texts):
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**batch), batch["attention_mask"]


def test_the_texts_run_past_64_tokens_up_to_the_context(classifier):
    lengths = [len(AutoTokenizer.from_pretrained(classifier)(t)["input_ids"]) for t in TEXTS]
    assert lengths[-1] > 64 and lengths[-1] <= 128, lengths


def test_classification_labels_and_probabilities_equal_transformers(classifier):
    model = AutoModelForSequenceClassification.from_pretrained(classifier).eval()
    output, _ = hidden_states(model, AutoTokenizer.from_pretrained(classifier), TEXTS)
    expected = torch.softmax(output.logits, -1).numpy()
    serving = js.from_pretrained(classifier)
    with js.serve(serving, name="classify"):
        together = js.batched_run("classify", TEXTS)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            alone = list(pool.map(lambda text: js.batched_run("classify", [text]), TEXTS))
    names = [model.config.id2label[i].encode() for i in expected.argmax(-1)]
    np.testing.assert_allclose(together["probabilities"], expected, atol=1e-5)
    assert together["label"].tolist() == names
    np.testing.assert_allclose(np.concatenate([a["probabilities"] for a in alone]), expected, atol=1e-5)
    assert np.ptp(expected, axis=0).max() > 0.01, "random weights blind to the text would prove little"


def test_embeddings_are_mean_pooled_over_the_mask_as_sentence_transformers(encoder):
    model = AutoModel.from_pretrained(encoder).eval()
    output, mask = hidden_states(model, AutoTokenizer.from_pretrained(encoder), TEXTS)
    weights = mask[..., None].float()
    expected = ((output.last_hidden_state * weights).sum(1) / weights.sum(1)).numpy()
    with js.serve(js.from_pretrained(encoder), name="embed"):
        got = js.batched_run("embed", TEXTS)["embedding"]
    np.testing.assert_allclose(got, expected, atol=1e-5)
    cls = js.from_pretrained(encoder, pooling="cls", normalize=True).run(TEXTS)["embedding"]
    first = output.last_hidden_state[:, 0].numpy()
    np.testing.assert_allclose(cls, first / np.linalg.norm(first, axis=-1, keepdims=True), atol=1e-5)


def test_a_classifier_checkpoint_serves_embeddings_too(classifier):
    model = AutoModel.from_pretrained(classifier).eval()
    output, mask = hidden_states(model, AutoTokenizer.from_pretrained(classifier), TEXTS[:2])
    weights = mask[..., None].float()
    expected = ((output.last_hidden_state * weights).sum(1) / weights.sum(1)).numpy()
    got = js.from_pretrained(classifier, task="embedding").run(TEXTS[:2])["embedding"]
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_a_text_longer_than_the_context_is_refused_with_both_lengths(classifier):
    with pytest.raises(js.ModelError, match=r"text 1 is \d+ tokens long; this model reads at most 128"):
        js.from_pretrained(classifier).run(["fine", " ".join(CORPUS)])
