"""A Llama 3-shaped model served from a Hugging Face checkpoint folder: ``js.from_pretrained`` reads its
``config.json`` (grouped-query attention, ``llama3`` rope scaling, a tied head), weights, ``tokenizer.json``
and chat template, and serves text in, text out with continuous batching over 8 slots, ending at either
end token of ``generation_config.json``. A Llama, Mistral or Qwen2 folder serves the same way.

Nothing is downloaded: ``make_checkpoint.py`` writes ``examples/weights/llama-small/`` the first time, with
Llama's key names, random weights from a fixed seed (the text reads as noise) and a byte-level BPE trained
on a short text. ``JITSERVE_LLAMA=full`` makes Llama 3.2 1B's shape instead (1.2 B parameters in bfloat16,
2.5 GB, made in about 30 s), for timing: of its 128,256 tokens the tokenizer has 512, and the tokens past
those decode to nothing.

    jitserve serve examples/llama.py:generation          # model "llama"
    jitserve serve --hf examples/weights/llama-small     # or the folder itself
"""

from make_checkpoint import llama

import jitserve as js

generation = js.from_pretrained(llama(), slots=8)
