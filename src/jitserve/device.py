"""``Device``: one device a compiler can run on, named by a URI.

It sits at the bottom of the layers: the NxIREE-style API (``iree.py``) and the
compilers both describe their devices with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Device:
    """One device a compiler can run on.

    ``uri`` names it (``xla:cpu:0``, ``local-task://``, ...); ``target_backend``
    is the compiler target that fits it where a compiler needs one (IREE);
    ``handle`` is the compiler's own device object.
    """

    compiler: str
    driver: str
    id: int
    uri: str
    description: str = ""
    target_backend: str | None = None
    handle: Any = field(default=None, compare=False, repr=False)
