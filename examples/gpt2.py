"""GPT-2 served from a Hugging Face checkpoint folder: ``js.from_pretrained`` reads its ``config.json``,
weights and ``tokenizer.json`` and serves text in, text out (streamed, sampled as each request asks, ended
at ``<|endoftext|>``), with continuous batching over 8 slots. Any GPT-2 folder serves the same way.

Nothing is downloaded: ``make_checkpoint.py`` writes the folder (``examples/weights/gpt2-small/``) on first
use as ``save_pretrained`` would, GPT-2's key names with random weights from a fixed seed (so the text reads
as noise) and a byte-level BPE trained on a short text. ``JITSERVE_GPT2=full`` makes GPT-2's own size
(124 M parameters, 500 MB), for timing: its vocabulary is GPT-2's 50,257 tokens, the tokenizer's 512 of
them, and the tokens past those decode to nothing. Serve it with

    jitserve serve examples/gpt2.py:generation           # model "gpt2": text_input in, text_output out
    jitserve serve --hf examples/weights/gpt2-small      # the same folder, read by the command line

or in process: ``with js.serve(generation, name="gpt2"): js.generate("gpt2", "Once upon a time")``.
"""

from make_checkpoint import gpt2

import jitserve as js

generation = js.from_pretrained(gpt2(), slots=8)
