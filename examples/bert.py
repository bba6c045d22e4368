"""A BERT classifier served from a Hugging Face checkpoint folder: ``js.from_pretrained`` reads its
``config.json``, weights and ``tokenizer.json`` (a WordPiece) and serves texts in, each text's label
(``id2label``) and probabilities out, batched; ``embedding`` is the same checkpoint's encoder answering
one vector per text (mean-pooled over its tokens). Texts may be as long as the model's context (128 tokens
at the small size), padded to compiled lengths.

Nothing is downloaded: ``make_checkpoint.py`` writes ``examples/weights/bert-small/`` on first use, as
``save_pretrained`` would: BERT's key names, random weights from a fixed seed and a WordPiece trained on a
short text (``JITSERVE_BERT=full``: BERT-base's size, 110 M parameters, 440 MB).

    jitserve serve examples/bert.py:serving              # model "bert": BYTES "text" in, "label" out
    jitserve serve examples/bert.py:embedding --name embed
    jitserve serve --hf examples/weights/bert-small      # the classifier, from the folder itself

In process: ``with js.serve(serving, name="bert"): js.batched_run("bert", ["What a great film"])``.
"""

from make_checkpoint import bert

import jitserve as js

serving = js.from_pretrained(bert())
embedding = js.from_pretrained(bert(), task="embedding")
