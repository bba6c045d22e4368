"""The examples as one `jitserve serve` target for tests/examples/test_example_errors.py, each made as its
example makes it, with fewer compiled sizes so that the server starts sooner: what the tests check, each
model's preprocess (from_pretrained's), does not depend on them. ``examples/llama.py:generation`` itself is
served by tests/protocol/test_openai.py."""

import sys
from pathlib import Path

import jitserve as js

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))  # as `jitserve serve` puts it there
from make_checkpoint import bert, llama
from mlp import serving as mlp

models = {"bert": js.from_pretrained(bert(), batch_size=1),
          "embed": js.from_pretrained(bert(), task="embedding", batch_size=1),
          "llama": js.from_pretrained(llama(), slots=2, max_length=32, prefill_lengths=[32]), "mlp": mlp}
