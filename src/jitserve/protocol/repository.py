"""A model repository (Triton's repository extension): models served from ``DIR/NAME/model.py``, loaded,
reloaded and unloaded by name while the others keep serving.

Each ``DIR/NAME/model.py`` defines ``serving`` (a :class:`jitserve.Serving` or
:class:`jitserve.Generation`), served as model ``NAME``, version 1. It runs as
a module of its own each time it is loaded, with ``__file__`` set, so that it
finds its weights beside it. A ``DIR/NAME/`` that holds a Hugging Face
checkpoint (``config.json``) and no ``model.py`` is served as
:func:`jitserve.from_pretrained` makes it, with its defaults. The control modes are Triton's
``--model-control-mode``:

- ``none``: every model is loaded at start; load and unload requests are refused.
- ``explicit``: only the models named at start are loaded; ``load`` and
  ``unload`` requests decide the rest.
- ``poll``: every model is loaded at start, and the directory is read again
  every ``poll_seconds``: a new model loads, a removed one unloads, a changed
  ``model.py`` reloads. Load and unload requests are refused, as Triton does.

A load of a loaded model reloads it, atomically: the new one is built and
warmed up beside the old one, then takes every new request while the old one
finishes what it holds and stops; the load returns once the new one answers.
When ``model.py`` (or a checkpoint's config and tokenizer files) is unchanged,
byte for byte, and the serving (or generation)
has weights of unchanged structure, shapes and dtypes, a reload swaps the
weights only (``Server.update_params``, ``GenerationServer.update_params``):
nothing compiles. A model whose ``model.py`` fails keeps its old version
serving (if it had one); the index and the client report the error's first
line, its paths shown from the repository (the model's folder as its name; the
log keeps them whole); the other models are untouched. Unloading drains, then frees.

Loads and unloads of one model run one at a time; at most ``max_loads_per_model`` of them (running or
waiting their turn, ``--max-loads-per-model``) are taken, one more is refused (503, as the service refuses
one past its global cap, ``MAX_CONTROLS``): so many loads of one slow model leave places for the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import sys
import threading
import types
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..errors import OptionError, QueueFullError, RepositoryError, UnknownServerError
from ..models import from_pretrained
from ..serving.generation import Generation
from ..serving.registry import is_servable, unstarted_server
from ..serving.serving import Serving
from .service import MAX_CONTROLS, InferenceService, hide_paths

log = logging.getLogger("jitserve.repository")
LOAD_THREAD = "jitserve-model-"  # the name of each thread a model.py (or a checkpoint's compile) runs on


def loads_running() -> list[str]:
    """The models whose load still runs on a thread of its own: unfinished, or abandoned at the load timeout
    (a model.py that never returns, a compile inside XLA)."""
    return [thread.name.removeprefix(LOAD_THREAD) for thread in threading.enumerate()
            if thread.name.startswith(LOAD_THREAD) and thread.is_alive()]


def exit_past_loads() -> None:
    """For ``jitserve serve`` once its servers have stopped: if a model's load still runs on its thread (a
    compile inside XLA, a model.py that never returns), end the process here, its logs flushed. Python's own
    exit would stop that thread wherever it is, and inside C++ that aborts the process ("terminate called
    ...") with no exit status 0."""
    running = loads_running()
    if running:
        logging.getLogger("jitserve.serve").warning("exiting with the load of %s still running: abandoned",
                                                    ", ".join(f"model '{name}'" for name in running))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

CONTROL_MODES = ("none", "explicit", "poll")
MODEL_FILE = "model.py"
CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "chat_template.jinja")  # a checkpoint folder's code: a change reloads it whole
WEIGHTS = b"\0weights:"  # in a checkpoint's source, what follows is its weight files' names, sizes and times
VERSION = "1"  # a repository model is served in one version
MAX_POLL_SECONDS = 86_400 * 365  # a year: beyond it a wait's timeout overflows
DEFAULT_LOAD_TIMEOUT = 600.0  # seconds a model.py (or a checkpoint's reading) may take before it is abandoned
DEFAULT_LOADS_PER_MODEL = 4  # loads and unloads of one model taken at once: the rest of MAX_CONTROLS for the others
_LOADS = itertools.count(1)  # each load's module gets a fresh name: nothing of an earlier load is reused


@dataclasses.dataclass
class _Model:
    """What the repository knows of one model: its state and why (Triton's ``READY``, ``UNAVAILABLE``,
    ``LOADING``, ``UNLOADING``), the ``model.py`` it serves, and the lock its loads and unloads take."""

    state: str = "UNAVAILABLE"
    reason: str = ""
    source: bytes | None = None  # the model.py (or checkpoint files, see _source) serving; None when nothing is
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class ModelRepository:
    """The models of ``directory`` served by ``service``, under ``mode`` (see the module's docstring).
    :meth:`start` loads what the mode loads at start; :meth:`stop` ends the polling (the service's owner
    stops the servers)."""

    def __init__(self, directory: str | Path, service: InferenceService, mode: str = "none",
                 poll_seconds: float = 15.0, load_timeout: float = DEFAULT_LOAD_TIMEOUT,
                 max_loads_per_model: int = DEFAULT_LOADS_PER_MODEL) -> None:
        if mode not in CONTROL_MODES:
            raise OptionError(f"--model-control-mode must be one of {', '.join(CONTROL_MODES)}, got {mode!r}")
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise OptionError(f"--model-repository {str(directory)!r} is not a directory")
        for flag, seconds in (("--repository-poll-secs", poll_seconds), ("--model-load-timeout", load_timeout)):
            if isinstance(seconds, bool) or not isinstance(seconds, int | float) \
                    or not 0.01 <= seconds <= MAX_POLL_SECONDS:
                raise OptionError(f"{flag} must be a number of seconds from 0.01 to {MAX_POLL_SECONDS:,}, got "
                                  f"{seconds!r}")
        if isinstance(max_loads_per_model, bool) or not isinstance(max_loads_per_model, int) \
                or not 1 <= max_loads_per_model <= MAX_CONTROLS:
            raise OptionError(f"--max-loads-per-model must be a count from 1 to {MAX_CONTROLS} (the loads and "
                              f"unloads of all models taken at once), got {max_loads_per_model!r}")
        self.load_timeout = float(load_timeout)
        self.max_loads_per_model = max_loads_per_model
        self._taken: dict[str, int] = {}  # model name -> its loads and unloads taken (running or waiting), under _guard
        self.service = service
        self.mode = mode
        self.poll_seconds = float(poll_seconds)
        self._models: dict[str, _Model] = {}
        self._guard = threading.Lock()  # over _models
        self._stopped = threading.Event()
        self._poller: threading.Thread | None = None

    # what the fronts call (InferenceService.control) -------------------------------------------

    def index(self, ready_only: bool) -> list[dict[str, str]]:
        """Every model in the directory, and every one still serving after its directory went, with its state."""
        names = sorted(set(self.names()) | {name for name, model in self._models.items()
                                            if model.state != "UNAVAILABLE"})
        ready = self.service.ready()
        entries = []
        for name in names:
            model = self._model(name)
            state = model.state if ready or model.state != "READY" else "UNAVAILABLE"
            entries.append({"name": name, "version": VERSION, "state": state,
                            "reason": model.reason if ready else self.service.unready_reason})
        return entries

    def load(self, name: str, parameters: Mapping[str, Any] | None) -> None:
        self._check_request("load", name, parameters, ignored=())
        with self._taken_one(name):
            self._load(name)

    def unload(self, name: str, parameters: Mapping[str, Any] | None) -> None:
        self._check_request("unload", name, parameters, ignored=("unload_dependents",))  # no dependents here
        with self._taken_one(name):
            self._unload(name)

    @contextlib.contextmanager
    def _taken_one(self, name: str) -> Iterator[None]:
        """A client's load or unload of ``name``, one of at most ``max_loads_per_model`` taken at once (the
        count of a name leaves with its last one: made-up names leave no trace)."""
        with self._guard:
            taken = self._taken.get(name, 0)
            if taken >= self.max_loads_per_model:
                raise QueueFullError(f"{taken} loads and unloads of model '{_shown(name)}' are running or waiting "
                                     f"(--max-loads-per-model); try again once one ends")
            self._taken[name] = taken + 1
        try:
            yield
        finally:
            with self._guard:
                self._taken[name] -= 1
                if not self._taken[name]:
                    del self._taken[name]

    def _check_request(self, action: str, name: str, parameters: Mapping[str, Any] | None,
                       ignored: Iterable[str]) -> None:
        if self.mode != "explicit":
            raise RepositoryError(f"model '{_shown(name)}': {action} requests are refused under --model-control-mode "
                                  f"{self.mode}; start with --model-control-mode explicit to {action} models")
        unknown = sorted(set(parameters or ()) - set(ignored))
        if unknown:
            raise RepositoryError(f"model '{_shown(name)}': {action} parameters ({', '.join(unknown)}) are not "
                                  f"supported; jitserve {action}s the model's {MODEL_FILE} or checkpoint as it is")

    # lifecycle ---------------------------------------------------------------------------------

    def start(self, load: Iterable[str] = ()) -> None:
        """Load every model (modes ``none`` and ``poll``) or those named in ``load`` (``explicit``): one that
        fails is reported and left unloaded; then, under ``poll``, start polling."""
        names = list(load) if self.mode == "explicit" else self.names()
        for name in names:
            self._load_logged(name)
        if self.mode == "poll":
            self._poller = threading.Thread(target=self._poll, name="jitserve-repository-poll", daemon=True)
            self._poller.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._poller is not None:
            self._poller.join()

    def names(self) -> list[str]:
        """The models of the directory: its subdirectories that hold a ``model.py`` or a ``config.json``."""
        return sorted(path.name for path in self.directory.iterdir() if _model_folder(path))

    def _poll(self) -> None:
        while not self._stopped.wait(self.poll_seconds):
            try:
                self._poll_once()
            except Exception as error:  # noqa: BLE001 - the directory went (a moment, or for good), or an unload
                # failed: the next poll looks again, whatever happened in this one
                log.error("model repository %s: a poll failed (%s: %s); polling goes on", self.directory,
                          type(error).__name__, error)

    def _poll_once(self) -> None:
        present = set(self.names())
        for name in sorted(present):
            source = self._source(name)
            if source is not None and source != self._model(name).source:
                self._load_logged(name)
        for name, model in list(self._models.items()):
            if name not in present and model.source is not None:
                self._unload(name)

    def _load_logged(self, name: str) -> None:
        try:
            self._load(name)
        except RepositoryError as error:
            if error.__cause__ is None:  # a model's own failure was logged by _load, with its paths
                log.error("%s", error)

    # loading -----------------------------------------------------------------------------------

    def _model(self, name: str) -> _Model:
        with self._guard:
            return self._models.setdefault(name, _Model())

    def _source(self, name: str) -> bytes | None:
        """What the model is made from: its ``model.py``; for a checkpoint folder, its config and tokenizer
        files, then (after ``WEIGHTS``) its weight files' names, sizes and modification times, so that a
        poll sees new weights and a reload of the same files swaps the weights only."""
        folder = self.directory / name
        try:
            if (folder / MODEL_FILE).is_file():
                return (folder / MODEL_FILE).read_bytes()
            code = b"".join(file.encode() + b"\0" + (folder / file).read_bytes() for file in CHECKPOINT_FILES
                            if (folder / file).is_file())
            weights = sorted(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in folder.iterdir()
                             if p.name.endswith((".safetensors", ".safetensors.index.json")))
            return code + WEIGHTS + "\n".join(weights).encode()
        except OSError:
            return None

    def _load(self, name: str) -> None:
        missing = RepositoryError(f"model '{_shown(name)}' is not in the repository: its folder holds no "
                                  f"{MODEL_FILE} and no config.json")
        # a name that is no model of the directory gets no entry: names clients make up must not pile up
        if not _folder_name(name) or not _model_folder(self.directory / name):
            raise missing
        model = self._model(name)
        with model.lock:
            source = self._source(name)  # read once no other load of it runs
            if source is None:  # removed meanwhile
                raise missing
            serving_now = model.source is not None
            if not serving_now:
                model.state, model.reason = "LOADING", ""
            try:
                serving = self._run_bounded(name, source)
                current = self.service.versions.get(name, {}).get(VERSION)
                same_code = model.source is not None and source.split(WEIGHTS)[0] == model.source.split(WEIGHTS)[0]
                if current is not None and same_code and current.server.takes_weights_of(serving):
                    current.server.update_params(serving.params)
                    log.info("model '%s' reloaded: new weights, nothing compiled", name)
                else:
                    self._replace(name, serving)
            except Exception as error:
                first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
                after = "; the version loaded before still serves" if serving_now else ""
                log.error("model '%s' failed to load: %s%s", name, first_line, after)  # the log keeps the paths
                shown = hide_paths(first_line, {f"{folder}{os.sep}": "" for folder in (self.directory,
                                                                                       self.directory.resolve())})
                model.state = "READY" if serving_now else "UNAVAILABLE"
                model.reason = f"{'reload' if serving_now else 'load'} failed: {shown}"
                raise RepositoryError(f"model '{name}' failed to load: {shown}{after}") from error
            model.state, model.reason, model.source = "READY", "", source

    def _run_bounded(self, name: str, source: bytes) -> Serving | Generation:
        """:meth:`_run` on a daemon thread, given ``load_timeout`` seconds: a model.py that never returns
        is abandoned there (Python cannot stop it), its load failed, and the model free to load again."""
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["serving"] = self._run(name, source)
            except Exception as error:  # noqa: BLE001 - handed to the load that waits for it
                outcome["error"] = error

        thread = threading.Thread(target=run, name=f"{LOAD_THREAD}{_shown(name)}", daemon=True)
        thread.start()
        thread.join(self.load_timeout)
        if thread.is_alive():
            raise RepositoryError(f"{MODEL_FILE} did not finish within {self.load_timeout:g} s "
                                  f"(--model-load-timeout); that run is abandoned")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["serving"]

    def _run(self, name: str, source: bytes) -> Serving | Generation:
        """Run ``model.py`` as a fresh module; its ``serving``. A checkpoint folder: ``from_pretrained``."""
        path = self.directory / name / MODEL_FILE
        if WEIGHTS in source and not path.is_file():
            return from_pretrained(str(self.directory / name))
        module = types.ModuleType(f"jitserve_repository_{name}_{next(_LOADS)}")
        module.__file__ = str(path)
        try:
            exec(compile(source, str(path), "exec"), module.__dict__)
        except (SystemExit, KeyboardInterrupt) as stop:  # a model's, not this process's: a failed load
            raise RepositoryError(f"{MODEL_FILE} raised {type(stop).__name__}({stop}) while it ran; a model "
                                  f"must define 'serving', not stop the server") from None
        serving = getattr(module, "serving", None)
        if not is_servable(serving):
            raise RepositoryError(f"{name}/{MODEL_FILE} must define serving = js.Serving(...) or "
                                  f"js.Generation(...); its 'serving' is {type(serving).__name__}")
        return serving

    def _replace(self, name: str, serving: Serving | Generation) -> None:
        """Warm up a server of ``serving``, send the model's new requests to it, then drain and stop the old one."""
        log.info("loading model '%s': %r", name, serving)
        server = unstarted_server(serving, name).start()
        old = self.service.put(f"{name}/{VERSION}", server)
        if old is not None:
            old.stop()
        log.info("model '%s' %s", name, "reloaded" if old is not None else "loaded")

    def _unload(self, name: str) -> None:
        if name not in self._models and name not in self.service.models:  # no entry for made-up names
            if name not in self.names():
                raise UnknownServerError(f"unknown model '{_shown(name)}': it is not in the repository and not "
                                         f"loaded")
            return  # never loaded: nothing to do, as Triton answers
        model = self._model(name)
        with model.lock:
            if model.source is None and name not in self.service.models:
                return  # not loaded: nothing to do, as Triton answers
            model.state, model.reason = "UNLOADING", ""
            for server in self.service.remove(name):
                server.stop()  # drained: what it holds finishes
            model.state, model.reason, model.source = "UNAVAILABLE", "unloaded", None
            log.info("model '%s' unloaded", name)


def _model_folder(folder: Path) -> bool:
    """Whether ``folder`` is a model: it holds a ``model.py``, or a checkpoint's ``config.json``."""
    return (folder / MODEL_FILE).is_file() or (folder / "config.json").is_file()


def _folder_name(name: str) -> bool:
    """Whether ``name`` can be a folder of the repository: one path part the filesystem takes (at most 255
    bytes, no NUL), not ``.`` or ``..``."""
    return "/" not in name and "\0" not in name and name not in ("", ".", "..") and len(name.encode()) <= 255


def _shown(name: str) -> str:
    """A client's model name as errors quote it: cut to 64 characters, so a long name is not sent back."""
    return name if len(name) <= 64 else f"{name[:64]}... ({len(name):,} characters)"
