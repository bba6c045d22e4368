"""Models the hardening tests serve: ``jitserve serve tests/protocol/hostile_models.py:models``."""


import jax.numpy as jnp
import numpy as np
from gates import gated

import jitserve as js
from jitserve.errors import ProtocolError

WIDE = 2**18  # "wide" answers each row with this many float32 values (1 MiB)

# what "raises" raises for an input row of value 0, 1, ...: exceptions of jitserve's own classes, raised by
# the model, must not pass for jitserve's verdict on the request
RAISED = (
    lambda: TimeoutError("model secret: timeout"),
    lambda: js.BatchError("model secret: batch"),
    lambda: ProtocolError("model secret: protocol"),
    lambda: js.QueueFullError("model secret: queue"),
    lambda: js.UnknownServerError("model secret: unknown"),
    lambda: js.ModelError("the input must be below 5", status=422),
    lambda: js.ModelError("said on purpose"),
)


def raises(x):
    raise RAISED[int(np.asarray(x)[0, 0])]()


def slow(x):
    gated("slow")
    return x + 1


models = {
    "raises": js.Serving(raises, batch_size=1, batch_timeout=0, compiler="eager",
                         input_template=js.template((1,), "float32")),
    "wide": js.Serving(lambda x: jnp.broadcast_to(x, (x.shape[0], WIDE)), batch_size=8, batch_timeout=0.001,
                       input_template=js.template((1,), "float32")),
    "slow": js.Serving(slow, batch_size=4, batch_timeout=0, compiler="eager",
                       input_template=js.template((1,), "float32")),
    "scores": js.Serving(lambda x: x * jnp.float32([0.1, 0.9, 0.5, 0.75, 0.2]), batch_size=4, batch_timeout=0.001,
                         input_template=js.template((1,), "float32"), labels={"output": ["cat", "dog", "cow", "owl"]}),
}
