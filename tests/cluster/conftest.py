"""Ray's settings for every test of this folder. Ray reads them when imported, so they are set here, before
any test module imports it (the unit tests of the Ray back end import it too): its own RAY_TMPDIR (nothing
left in /tmp/ray for other processes to join), token authentication, and the driver kept on loopback."""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path

_TMP = tempfile.mkdtemp(prefix="jitserve-ray-")
Path(_TMP, "token").write_text(secrets.token_hex(32))
os.environ.update(RAY_TMPDIR=_TMP, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(Path(_TMP, "token")),
                  RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
