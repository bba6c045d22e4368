"""The checkpoint's tokenizer through ``tokenizers`` alone: token ids as ``transformers`` gives them,
streaming text that never splits a character or repeats a piece, and the chat template rendered as
``transformers`` renders it."""

from __future__ import annotations

from transformers import AutoTokenizer

from jitserve.models import Tokenizer
from jitserve.models.checkpoint import Checkpoint

TEXTS = ["a", "Once upon a time", "naïve café ✓ 東京 Ελληνικά", "", "  spaces  and\nnew lines\t"]


def test_token_ids_equal_transformers(made):
    for variant in ("gpt2-8-heads", "llama-tied"):
        ours, theirs = Tokenizer(Checkpoint(made(variant))), AutoTokenizer.from_pretrained(made(variant))
        for text in TEXTS:
            assert ours.encode(text).tolist() == theirs(text)["input_ids"], (variant, text)
            assert ours.encode(text.encode()).tolist() == theirs(text)["input_ids"]


def test_a_stream_gives_whole_characters_once_and_joins_to_the_decoded_text(made):
    tokenizer = Tokenizer(Checkpoint(made("llama-tied")))
    text = " naïve café ✓ 東京 Ελληνικά, Once upon a time"
    ids = tokenizer.encode(text)[1:]
    single_bytes = [i for i in ids.tolist() if "\ufffd" in tokenizer.decode([i])]
    assert single_bytes, "the text must hold characters split across tokens"
    stream = tokenizer.stream(tokenizer.encode("Hello"))
    pieces = [stream.feed(i) for i in ids] + [stream.finish()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_an_unfinished_character_at_the_end_comes_out_as_decoding_shows_it(made):
    tokenizer = Tokenizer(Checkpoint(made("llama-tied")))
    ids = [i for i in tokenizer.encode("✓").tolist()[1:]]
    stream = tokenizer.stream([])
    assert [stream.feed(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert stream.finish() == tokenizer.decode(ids[:-1])


def test_encoding_without_special_tokens_is_transformers(made):
    """What a chat template renders is encoded as apply_chat_template(tokenize=True) encodes it: no BOS added."""
    folder = made("llama-tied")
    ours = Tokenizer(Checkpoint(folder))
    reference = AutoTokenizer.from_pretrained(folder)
    for text in ("<|begin_of_text|>Hello", "Hello ✓ there"):
        assert ours.encode(text, special=False).tolist() == reference(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text).tolist() == reference(text)["input_ids"]
    assert ours.encode("Hello")[0] == ours.bos and ours.encode("Hello", special=False)[0] != ours.bos


def test_the_chat_template_renders_as_transformers(made):
    folder = made("llama-tied")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✓"}]
    ours = Tokenizer(Checkpoint(folder)).render_chat(messages)
    assert ours == AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, add_generation_prompt=True,
                                                                              tokenize=False)
