"""The checkpoint's tokenizer through ``tokenizers`` alone: token ids as ``transformers`` gives them,
streaming text that never splits a character or repeats a piece, and the chat template rendered as
``transformers`` renders it."""

from __future__ import annotations

import random

from checkpoints import TOKENIZERS, VARIANTS
from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer

from jitserve.models import Tokenizer
from jitserve.models.checkpoint import Checkpoint
from jitserve.models.tokenizer import CONTEXT_TOKENS

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


def generative_tokenizers(made):
    """The distinct tokenizers of the made checkpoints that generate text (each variant's tokenizer.json once)."""
    distinct = {}
    for variant in [*VARIANTS, *TOKENIZERS]:
        folder = made(variant)
        distinct.setdefault((folder / "tokenizer.json").read_bytes(), (variant, folder))
    return list(distinct.values())


def generated_text(tokenizer, context, ids):
    """What a stream should give for ``ids`` after ``context`` (the prompt's last CONTEXT_TOKENS ids): the
    text that decoding them after the context adds to the context's own text, from the first character where
    the two differ (a prompt ending in an unfinished character has that character finished by ``ids``)."""
    before, after = tokenizer.decode(context), tokenizer.decode([*context, *ids])
    alike = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
    return after[alike:]


def id_drawer(rng, tokenizer):
    """``draw(count)``: token ids from the whole vocabulary, a third of them bytes of unfinished characters
    (U+FFFD alone), a sixth special tokens or ids past the vocabulary, which decode to nothing."""
    vocabulary = tokenizer.vocabulary
    partial = [i for i in range(vocabulary) if "\ufffd" in tokenizer.decode([i])]
    empty = [i for i in range(vocabulary) if tokenizer.decode([i]) == ""] + [vocabulary, vocabulary + 7]
    kinds = [lambda: rng.randrange(vocabulary)] * 3 + [lambda: rng.choice(partial)] * 2 + [lambda: rng.choice(empty)]
    return lambda count: [rng.choice(kinds)() for _ in range(count)]


def stream_pieces(tokenizer, prompt, ids):
    stream = tokenizer.stream(prompt)
    pieces = [stream.feed(i) for i in ids]
    pieces.append(stream.finish())
    assert stream.finish() == "", "a second finish() gives nothing more"
    return pieces


def decode_stream_pieces(tokenizer, context, ids):
    """What ``tokenizers``' own DecodeStream gives for ``ids``, stepped through ``context`` first."""
    stream = DecodeStream(skip_special_tokens=True)
    for i in context:
        stream.step(tokenizer.rust, i)
    return [stream.step(tokenizer.rust, i) or "" for i in ids]


def test_any_token_ids_stream_as_they_decode_whole_and_once(made):
    """A model may generate any ids: the pieces of each of 600 random sequences per tokenizer (1 to 40 ids,
    after no prompt, a text's prompt or random ids) join to the text decoding gives (``generated_text``), so
    no character is split, changed after it went out, sent twice or lost, after special tokens and at
    finish() too. After a text's prompt, the prompt's last CONTEXT_TOKENS ids read as the whole prompt, and a
    byte-level tokenizer's pieces are DecodeStream's (on a byte-fallback one DecodeStream sends a run's
    text before the run ends, raises InvalidPrefix once a later byte turns it into U+FFFD)."""
    rng = random.Random(20240611)
    for variant, folder in generative_tokenizers(made):
        tokenizer = Tokenizer(Checkpoint(folder))
        prompts, draw = [[], *(tokenizer.encode(text) for text in TEXTS)], id_drawer(rng, tokenizer)
        for case in range(600):
            text = case % (len(prompts) + 1)  # 0: a prompt of random ids
            prompt = prompts[text - 1] if text else draw(rng.randrange(13))
            ids = draw(rng.randint(1, 40))
            pieces = stream_pieces(tokenizer, prompt, ids)
            expected = generated_text(tokenizer, prompt[-CONTEXT_TOKENS:], ids)
            assert "".join(pieces) == expected, (variant, prompt, ids, pieces, expected)
            if text:
                assert expected == generated_text(tokenizer, prompt, ids), (variant, prompt, ids)
            if text and tokenizer.byte_runs is None:
                assert pieces[:-1] == decode_stream_pieces(tokenizer, prompt[-CONTEXT_TOKENS:], ids), (variant, ids)


def test_a_byte_fallback_run_goes_out_when_it_ends(made):
    """Llama 2-style bytes decode as one run: "é" (C3 A9) reads as three U+FFFD once E2 follows it and "▁b"
    ends the run, so nothing goes out before the run ends."""
    tokenizer = Tokenizer(Checkpoint(made("llama2-byte-fallback")))
    ids = [tokenizer.rust.token_to_id(piece) for piece in ("<0xC3>", "<0xA9>", "<0xE2>", "\u2581b")]
    stream = tokenizer.stream([])
    assert [stream.feed(i) for i in ids] + [stream.finish()] == ["", "", "", "\ufffd" * 3 + " b", ""]
    assert tokenizer.decode(ids) == "\ufffd" * 3 + " b"
    stream = tokenizer.stream([])
    assert [stream.feed(i) for i in ids[:2]] + [stream.finish()] == ["", "", "é"]
