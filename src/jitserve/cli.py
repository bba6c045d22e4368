"""The ``jitserve`` command line: ``serve``, ``front``, ``bench``, ``demo``, ``devices`` and ``mlir``.

``serve TARGET`` serves a ``Serving`` or ``Generation`` (or a dict of them) named by
``path/to/file.py:attr`` or ``package.module:attr`` over HTTP and gRPC with
the Open Inference Protocol (``--ray ADDRESS --replicas N``: on a Ray cluster).
``front --ray ADDRESS`` serves the servings already running on a Ray cluster.
``bench TARGET`` serves it in process and drives it with closed-loop callers
for a while. ``demo`` is the evaluator-against-XLA table for this
machine: softmax on 1,000, 1,000,000 and 1000x1000x5 elements with every
installed compiler, next to numpy eager.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import jax
import numpy as np

from . import compilers
from .compilers.xla import run_cpu_computations_inline
from .defaults import keep_compiled
from .defn import devices, jit, to_mlir
from .errors import JitserveError, OptionError
from .template import is_template
from .version import __version__
from .workloads import DEMO_SHAPES, softmax, softmax_numpy, time_call


def _format_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def demo(args: argparse.Namespace) -> int:
    names = compilers.installed()
    rng = np.random.default_rng(12)
    header = ["input", "numpy eager", *names, *(f"{n} speed-up" for n in names)]
    rows = []
    for label, shape in DEMO_SHAPES.items():
        x = rng.uniform(size=shape).astype(np.float32)
        base = time_call(functools.partial(softmax_numpy, x), args.budget)
        times = []
        for name in names:
            fn = jit(softmax, compiler=name)
            np.testing.assert_allclose(np.asarray(fn(x)), softmax_numpy(x), rtol=1e-5, atol=1e-7)
            times.append(time_call(functools.partial(fn, x), args.budget))
        rows.append([label, _format_ms(base), *map(_format_ms, times), *(f"{base / t:.1f}x" for t in times)])
        print(f"  measured softmax on {label} elements", file=sys.stderr, flush=True)
    _print_table(header, rows)
    return 0


def _print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(line(row))


def list_devices(args: argparse.Namespace) -> int:
    for device in devices():
        print(f"{device.compiler:10} {device.uri:24} {device.description}")
    return 0


def _shape(text: str) -> tuple[int, ...]:
    """``--shape``: dimensions joined by ``x`` (``1000x1000x5``; empty for a scalar)."""
    dimensions = text.split("x") if text else []
    if not all(d.isdigit() for d in dimensions):
        raise argparse.ArgumentTypeError(f"expected dimensions joined by 'x', each a non-negative integer "
                                         f"(e.g. 1000x1000x5, or '' for a scalar); got {text!r}")
    return tuple(int(d) for d in dimensions)


def mlir(args: argparse.Namespace) -> int:
    module_name, _, attribute = args.target.partition(":")
    fn = getattr(importlib.import_module(module_name), attribute)
    print(to_mlir(fn, [jax.ShapeDtypeStruct(args.shape, args.dtype)]).mlir_module)
    return 0


def _importable(folder: str) -> None:
    if folder not in sys.path:
        sys.path.insert(0, folder)


def load_target(target: str) -> Any:
    """The object named by ``path/to/file.py:attr`` or ``package.module:attr``; what stops it loading
    (no such file or module, a syntax error, an exception while it runs) is one :class:`OptionError` line."""
    location, _, attribute = target.rpartition(":")
    if not location or not attribute:
        raise OptionError(f"TARGET must look like path/to/file.py:attr or package.module:attr, got {target!r}")
    _importable(str(Path.cwd()))  # as python -m and uvicorn do: the working directory's packages import
    try:
        if location.endswith(".py"):
            if not Path(location).is_file():
                raise OptionError(f"no such file: {location}")
            _importable(str(Path(location).resolve().parent))  # its sibling modules import, as under python file.py
            spec = importlib.util.spec_from_file_location(f"jitserve_target_{abs(hash(location))}", location)
            if spec is None or spec.loader is None:
                raise OptionError(f"cannot load {location} as a Python file")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(location)
    except OptionError:
        raise
    except SyntaxError as error:
        raise OptionError(f"{location}:{error.lineno}: syntax error: {error.msg} (--debug shows the traceback)") \
            from error
    except Exception as error:
        raise OptionError(f"cannot load {location}: {type(error).__name__}: {error} (--debug shows the traceback)") \
            from error
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise OptionError(f"{location} has no attribute {attribute!r}") from None


def _default_name(target: str) -> str:
    """A single serving's model name: its file's stem (``examples/mlp.py:serving`` -> ``mlp``) or its
    module's last part (``pkg.models:mlp`` -> ``models``)."""
    location = target.rpartition(":")[0]
    return Path(location).stem if location.endswith(".py") else location.rpartition(".")[2]


def load_servings(args: argparse.Namespace) -> dict[str, Any]:
    """The target's servings (and generations) by name, or the ``--hf`` checkpoints', with the command line's
    overrides applied."""
    from .models import from_pretrained
    from .serving import Serving
    from .serving.registry import is_servable

    # serve's, not bench's
    hf, task, dtype, devices = (getattr(args, name, None) for name in ("hf", "task", "dtype", "devices"))
    generating = {flag: value for flag in GENERATION_FLAGS if (value := getattr(args, flag, None)) is not None}
    if hf:
        if args.name is not None and len(hf) > 1:
            raise OptionError("--name names one model: leave it out with several --hf folders (each is named "
                              "after its folder)")
        found: Any = {args.name or Path(folder).resolve().name: from_pretrained(
            folder, task=task, dtype=dtype, compiler=args.compiler, devices=devices, **generating) for folder in hf}
    elif task is not None or dtype is not None or devices is not None or generating:
        flags = ", ".join("--" + flag.replace("_", "-") for flag in GENERATION_FLAGS)
        raise OptionError(f"--task, --dtype, --devices and {flags} apply to a checkpoint: give them with --hf DIR")
    else:
        found = load_target(args.target)
    if not (isinstance(found, dict) or is_servable(found)):
        raise OptionError(f"{args.target} is a {type(found).__name__}, not a jitserve.Serving or Generation or a "
                          f"dict of them")
    servings = _by_version(found) if isinstance(found, dict) else {args.name or _default_name(args.target): found}
    target = args.target or "--hf"
    changes = {k: v for k, v in _overrides(args).items() if not (hf and k == "compiler")}  # --hf: given above
    for name, serving in servings.items():
        if not is_servable(serving):
            raise OptionError(f"{target}: '{name}' is a {type(serving).__name__}, not a jitserve.Serving "
                              f"or Generation")
        if serving.generates:
            if changes:
                raise OptionError(f"{target}: '{name}' is a jitserve.Generation: "
                                  f"{', '.join('--' + k.replace('_', '-') for k in changes)} apply to a Serving; set "
                                  f"a generation's options where it is made")
            continue
        servings[name] = cast(Serving, serving).replace(**changes) if changes else serving
    return servings


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The Serving options the command line overrides."""
    return {k: v for k, v in [("batch_size", args.batch_size), ("batch_timeout", args.batch_timeout),
                              ("compiler", args.compiler)] if v is not None}


GENERATION_FLAGS = {  # from_pretrained's generation options -> (type, help); each is the flag --name-with-dashes
    "slots": (int, "the most sequences one step runs (default 32 with the paged cache, 8 with the slot cache)"),
    "max_length": (int, "tokens per sequence, prompt and outputs (default the context, at most 2,048)"),
    "kv_cache": (str, "paged (blocks of one pool, the default) or slots (a max-length row per slot)"),
    "kv_cache_tokens": (int, "the paged cache's positions, every sequence's together (default 8 x max length)"),
}
API_KEY_ENV = "JITSERVE_API_KEY"
LIMIT_FLAGS = {  # Limits field -> (type, help); each is the flag --field-with-dashes
    "max_body_bytes": (int, "largest request body or gRPC message, bytes; larger is 413 / RESOURCE_EXHAUSTED"),
    "max_header_bytes": (int, "largest request line and headers, bytes; larger is 431"),
    "read_timeout": (float, "seconds a client has to send its headers, and may pause within its body; then 408"),
    "write_timeout": (float, "seconds a client may stop reading its response before the connection is aborted"),
    "max_connections": (int, "open HTTP connections; one more is answered 503 and closed"),
    "max_grpc_calls": (int, "gRPC calls in flight; one more is refused RESOURCE_EXHAUSTED"),
    "max_grpc_connections": (int, "open gRPC connections, counted from accept; one more is closed at once"),
    "idle_timeout": (float, "seconds a gRPC connection may go without a call before it is closed (GOAWAY)"),
    "max_stream_requests": (int, "requests of one gRPC stream in flight; beyond, the stream is not read"),
    "stream_buffer_bytes": (int, "reply bytes of one gRPC stream waiting for its client; beyond, requests wait"),
}


def _by_version(found: dict[str, Any]) -> dict[str, Any]:
    """A dict of servings with a dict of versions in place of a serving (``{"m": {"1": a, "2": b}}``) as the
    keys the network service reads: ``m/1``, ``m/2``."""
    servings: dict[str, Any] = {}
    for name, value in found.items():
        if not isinstance(value, dict):
            servings[name] = value
            continue
        for version, serving in value.items():
            if not isinstance(version, str) or not version or "/" in version:
                raise OptionError(f"model '{name}': version {version!r} must be a non-empty string without '/'")
            servings[f"{name}/{version}"] = serving
    return servings


def _network_options(args: argparse.Namespace) -> dict[str, Any]:
    from .protocol.access import Access
    from .protocol.limits import Limits, Tls

    limits = Limits(**{name: getattr(args, name) for name in LIMIT_FLAGS if getattr(args, name) is not None})
    if (args.tls_cert is None) != (args.tls_key is None):
        raise OptionError("--tls-cert and --tls-key go together: give both, or neither")
    tls = None if args.tls_cert is None else Tls(args.tls_cert, args.tls_key)
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    return {"host": args.host, "port": args.port, "grpc_port": None if args.no_grpc else args.grpc_port,
            "request_timeout": args.request_timeout, "drain_timeout": args.drain_timeout, "limits": limits,
            "access": Access(api_key, tuple(args.cors_origin or ())), "tls": tls, "access_log": args.access_log,
            "trace_endpoint": args.trace_endpoint, "allow_client_shm": args.allow_client_shm,
            "http_workers": args.http_workers}


def _logging(args: argparse.Namespace) -> None:
    from .protocol import logs

    logs.configure(args.log_format)


def serve_command(args: argparse.Namespace) -> int:
    from .protocol import app
    from .protocol.repository import exit_past_loads

    if [args.target is not None, bool(args.hf), args.model_repository is not None].count(True) != 1:
        raise OptionError("serve takes one of a TARGET, --hf DIR or --model-repository DIR")
    app.check_http_workers(args.http_workers)  # before anything changes this process (JAX's CPU dispatch)
    repository = None
    if args.model_repository is not None:
        if args.ray is not None or args.name is not None or _overrides(args):
            raise OptionError("--model-repository serves each DIR/NAME/model.py as it is: --ray, --name, "
                              "--batch-size, --batch-timeout and --compiler do not apply to it")
        repository = app.start_repository(args.model_repository, args.model_control_mode,
                                          args.repository_poll_secs, tuple(args.load_model or ()),
                                          args.model_load_timeout, args.max_loads_per_model)
    keep_compiled(not args.no_compile_cache)  # the options checked: this process changes from here on
    run_cpu_computations_inline()  # before a model's module runs anything on JAX's CPU client
    _logging(args)
    if repository is not None:
        app.run(lambda servers: None, attach=repository, **_network_options(args))
        exit_past_loads()
        return 0
    servings = load_servings(args)
    if args.ray is None:
        app.run(app.start_locally(servings), **_network_options(args))
        return 0
    from .cluster import ray as cluster
    from .serving import lookup

    _connect(cluster, args.ray)
    handles: list[Any] = []

    def start(servers: dict[str, Any]) -> None:
        for name, serving in servings.items():
            logging.getLogger("jitserve.serve").info("starting %d replicas of model '%s' on the ray cluster at %s",
                                                     args.replicas, name, args.ray)
            autoscaling = None if args.max_replicas is None else cluster.Autoscaling(
                args.min_replicas or 1, args.max_replicas)
            handles.append(cluster.serve(serving, name, replicas=args.replicas, owned=True, autoscaling=autoscaling))
            servers[name] = lookup(("ray", name))

    def stop_replicas() -> None:
        for handle in handles:
            handle.stop()

    app.run(start, on_exit=stop_replicas, **_network_options(args))
    return 0


def front_command(args: argparse.Namespace) -> int:
    from .cluster import ray as cluster
    from .protocol import app

    _logging(args)
    _connect(cluster, args.ray)
    if not (args.models or cluster.running_servings()):
        logging.getLogger("jitserve.serve").warning(
            "no servings run in the ray cluster at %s yet; each is served once it is deployed (jitserve serve "
            "FILE:serving --ray %s)", args.ray, args.ray)
    app.run(lambda servers: None, attach=lambda service: cluster.FrontSync(service, args.models),
            **_network_options(args))
    return 0


def _connect(cluster: Any, address: str) -> None:
    """Connect to the Ray cluster at ``address``. While it tries, Ray's C++ client writes a warning per
    second to the process's stderr (a refused token: 20 of them); those lines are held back, and shown only
    if the connection succeeds, so that a refused one is the single line of ``connect``'s error."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            cluster.connect(address)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        held.seek(0)
        sys.stderr.write(held.read().decode(errors="replace"))


def cluster_command(args: argparse.Namespace) -> int:
    """``jitserve cluster list`` and ``jitserve cluster stop``: what runs on a Ray cluster, and stopping it."""
    from .cluster import ray as cluster

    _connect(cluster, args.ray)
    if args.action == "list":
        rows = cluster.describe()
        columns = ("serving", "replica", "node", "pid", "owner", "state")
        widths = [max([len(column), *(len(str(row[column])) for row in rows)]) for column in columns]
        for line in [dict(zip(columns, (c.upper() for c in columns))), *rows]:
            print("  ".join(str(line[column]).ljust(width) for column, width in zip(columns, widths)).rstrip())
        stale = sum(row["state"] == "stale" for row in rows)
        if stale:
            print(f"{stale} stale replicas (their owner is gone): 'jitserve cluster stop --stale --ray {args.ray}' "
                  f"stops them, or restarting their 'jitserve serve --ray' adopts them")
        return 0
    if not args.names and not args.stale:
        raise OptionError("cluster stop needs the servings to stop (NAME ...) or --stale")
    stopped = cluster.stop_servings(args.names, stale=args.stale)
    print(f"stopped {len(stopped)} replicas{': ' + ', '.join(stopped) if stopped else ''}")
    return 0


def bench_command(args: argparse.Namespace) -> int:
    from .batch import Batch
    from .loadtest import closed_loop, closed_loop_async
    from .serving import batched_run, batched_run_async, serve

    run_cpu_computations_inline()  # as jitserve serve does: what this measures is what it serves
    servings = load_servings(args)
    name = args.name if args.name in servings else next(iter(servings))
    serving = servings[name]
    if serving.generates:
        raise OptionError(f"model '{name}' is a jitserve.Generation; jitserve bench measures a Serving (for a "
                          f"generation, see bench/generation.py)")
    if serving.input_template is None:
        raise OptionError(f"model '{name}' has no input_template: jitserve bench needs one to make inputs")

    def make_call(seed: int) -> Any:
        rng = np.random.default_rng(seed)
        entry = jax.tree_util.tree_map(lambda t: rng.uniform(size=(args.rows, *t.shape)).astype(t.dtype),
                                       serving.input_template, is_leaf=is_template)
        batch = Batch.concatenate([entry])

        async def call_async() -> int:
            await batched_run_async(name, batch)
            return args.rows

        return call_async if args.use_async else (lambda: (batched_run(name, batch), args.rows)[1])

    with serve(serving, name=name) as server:
        before = server.stats()
        load = (closed_loop_async if args.use_async else closed_loop)(make_call, args.callers, args.seconds)
        stats = server.stats()
    batches = stats.batches - before.batches
    executed = sum(size * count for size, count in stats.batch_sizes.items())
    print(f"model '{name}': {serving!r}, {args.callers} {'asyncio tasks' if args.use_async else 'threads'} "
          f"x {args.rows} rows per request, {args.seconds:g} s")
    print("| rows/s | p50 ms | p99 ms | mean batch | padding waste | compiles during load |")
    print("|---|---|---|---|---|---|")
    print(f"| {load.rows_per_s:,.0f} | {load.percentile(50) * 1e3:.2f} | {load.percentile(99) * 1e3:.2f} "
          f"| {(stats.rows - before.rows) / max(batches, 1):.1f} "
          f"| {100 * stats.padded_rows / max(executed, 1):.1f}% | {stats.compiles - before.compiles} |")
    return 0


def _add_network(parser: argparse.ArgumentParser) -> None:
    """Where and how the network fronts listen."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    parser.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (default 8001)")
    parser.add_argument("--no-grpc", action="store_true", help="serve HTTP only")
    parser.add_argument("--http-workers", type=int, metavar="N", help="serve HTTP from N front processes on the "
                        "port (SO_REUSEPORT) that decode requests and hand their tensors to this process, which "
                        "batches them, through shared memory (default: HTTP in this process)")
    parser.add_argument("--request-timeout", type=float, help="seconds a request may wait before it starts "
                        "(default: the serving's own timeouts)")
    from .protocol.limits import Limits

    for name, (kind, text) in LIMIT_FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=kind,
                            help=f"{text} (default {getattr(Limits, name):,})")
    parser.add_argument("--drain-timeout", type=float, help="on SIGTERM, seconds to finish queued requests before "
                        "answering the rest with an error (default: until all are done)")


def _add_logging(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-format", choices=("text", "json"), default="text",
                        help="log lines as text, or one JSON object per line (default text)")
    parser.add_argument("--access-log", action="store_true", help="log one line per inference request (id, model, "
                        "version, protocol, status, rows, latency) on the jitserve.access logger")
    parser.add_argument("--trace-endpoint", metavar="URL", help="send OpenTelemetry spans of requests and batches "
                        "to this OTLP/HTTP collector, e.g. http://127.0.0.1:4318/v1/traces (pip install "
                        "'jitserve[trace]')")


def _add_security(parser: argparse.ArgumentParser) -> None:
    """Who may call the server, and over what."""
    parser.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' on every call but health checks "
                        f"(HTTP 401 / gRPC UNAUTHENTICATED without it; default: ${API_KEY_ENV}, else open)")
    parser.add_argument("--tls-cert", metavar="PEM", help="certificate chain: serve HTTPS and gRPC over TLS")
    parser.add_argument("--tls-key", metavar="PEM", help="the certificate's private key")
    parser.add_argument("--cors-origin", action="append", metavar="ORIGIN",
                        help="a browser origin allowed to call the server (repeat; '*' for any; default none)")
    parser.add_argument("--allow-client-shm", action="store_true", help="let clients on this machine register "
                        "system shared memory regions for inputs and outputs (Triton's extension; off by default: "
                        "a client may then read and write any shared memory object this server may open)")


def _add_overrides(parser: argparse.ArgumentParser) -> None:
    """The options that change a loaded Serving (see :func:`load_servings`)."""
    parser.add_argument("--batch-size", type=int, help="override the serving's batch_size")
    parser.add_argument("--batch-timeout", type=float, help="override the serving's batch_timeout (seconds)")
    parser.add_argument("--compiler", help="override the serving's compiler (xla, iree, evaluator, eager)")


SERVE_EXAMPLES = """examples:
  jitserve serve examples/mlp.py:serving                 # model 'mlp' on 127.0.0.1:8000 (HTTP), :8001 (gRPC)
  jitserve serve models.py:servings --host 0.0.0.0       # a dict of name -> Serving, on every interface
  jitserve serve pkg.models:mlp --api-key "$KEY" --tls-cert cert.pem --tls-key key.pem
  jitserve serve examples/mlp.py:serving --ray 127.0.0.1:6379 --replicas 2
  jitserve serve --model-repository models/ --model-control-mode explicit --load-model mlp
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="jitserve", description="Compile jax.numpy functions with XLA, IREE or a numpy evaluator and serve "
        "them with dynamic batching (Open Inference Protocol over HTTP and gRPC).")
    parser.add_argument("--version", action="version", version=f"jitserve {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser(
        "serve", help="serve a Serving over HTTP and gRPC (Open Inference Protocol)", epilog=SERVE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve a js.Serving or js.Generation, or a dict of name -> either, until SIGINT/SIGTERM.")
    serve_parser.add_argument("target", nargs="?", help="path/to/file.py:attr or package.module:attr (a Serving or "
                              "a dict); the working directory and the file's folder are importable")
    serve_parser.add_argument("--hf", action="append", metavar="DIR", help="serve the Hugging Face checkpoint "
                              "folder DIR (js.from_pretrained) as model DIR's name, instead of a TARGET "
                              "(repeatable)")
    serve_parser.add_argument("--task", choices=("generation", "classification", "embedding"),
                              help="with --hf: what to serve the checkpoint as (default: its architecture's task)")
    serve_parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                              help="with --hf: the weights' dtype (default: as stored)")
    serve_parser.add_argument("--devices", type=int, metavar="N",
                              help="with --hf: split a generation's weights and KV cache over N devices of this "
                              "host (tensor parallel; default one device)")
    for flag, (kind, text) in GENERATION_FLAGS.items():
        serve_parser.add_argument(f"--{flag.replace('_', '-')}", type=kind, metavar="N" if kind is int else None,
                                  choices=("paged", "slots") if flag == "kv_cache" else None,
                                  help=f"with --hf, a generation: {text}")
    serve_parser.add_argument("--model-repository", metavar="DIR", help="serve DIR/NAME/model.py (each defines "
                              "'serving'), or DIR/NAME/config.json (a checkpoint), as model NAME, instead of a "
                              "TARGET")
    serve_parser.add_argument("--model-control-mode", choices=("none", "explicit", "poll"), default="none",
                              help="as Triton's: none loads every model at start, explicit loads what load "
                              "requests (and --load-model) name, poll rescans DIR (default none)")
    serve_parser.add_argument("--load-model", action="append", metavar="NAME",
                              help="with --model-control-mode explicit, a model to load at start (repeatable)")
    serve_parser.add_argument("--repository-poll-secs", type=float, default=15.0,
                              help="with --model-control-mode poll, seconds between scans of DIR (default 15)")
    serve_parser.add_argument("--model-load-timeout", type=float, default=600.0,
                              help="seconds a repository model's model.py (or checkpoint) may take to load before "
                              "the load fails and that run is abandoned (default 600)")
    serve_parser.add_argument("--max-loads-per-model", type=int, default=4, metavar="N",
                              help="load and unload requests of one repository model taken at once, running or "
                              "waiting their turn; one more is refused 503 (default 4; all models: 16)")
    serve_parser.add_argument("--no-compile-cache", action="store_true", help="compile every program again at "
                              "start (default: kept in $JITSERVE_CACHE_DIR, else ~/.cache/jitserve, for restarts)")
    serve_parser.add_argument("--name", help="the model name of a single Serving (default: the file's or module's "
                              "name, e.g. 'mlp' for examples/mlp.py:serving)")
    _add_network(serve_parser)
    _add_security(serve_parser)
    _add_logging(serve_parser)
    _add_overrides(serve_parser)
    serve_parser.add_argument("--ray", metavar="ADDRESS", help="start the replicas on the Ray cluster at ADDRESS "
                              "(host:port of its head) and route to them")
    serve_parser.add_argument("--replicas", type=int, default=1, help="replicas per model with --ray (default 1)")
    serve_parser.add_argument("--min-replicas", type=int, help="with --ray and --max-replicas: the fewest replicas "
                              "autoscaling keeps (default 1)")
    serve_parser.add_argument("--max-replicas", type=int, help="with --ray: scale each model between "
                              "--min-replicas and this many replicas by its queue")
    serve_parser.set_defaults(run=serve_command)
    front_parser = commands.add_parser("front", help="serve HTTP and gRPC for servings already running on a Ray "
                                       "cluster")
    front_parser.add_argument("--ray", metavar="ADDRESS", required=True, help="host:port of the Ray cluster's head")
    front_parser.add_argument("--models", nargs="*", help="which servings (default: every one in the cluster)")
    _add_network(front_parser)
    _add_security(front_parser)
    _add_logging(front_parser)
    front_parser.set_defaults(run=front_command)
    cluster_parser = commands.add_parser("cluster", help="list or stop what runs on a Ray cluster")
    cluster_parser.add_argument("action", choices=("list", "stop"), help="list every replica (serving, node, "
                                "owner, state), or stop servings")
    cluster_parser.add_argument("names", nargs="*", metavar="NAME", help="with stop: the servings to stop")
    cluster_parser.add_argument("--stale", action="store_true", help="with stop: also every replica whose "
                                "owner ('jitserve serve --ray') is gone without stopping it")
    cluster_parser.add_argument("--ray", metavar="ADDRESS", required=True, help="host:port of the cluster's head")
    cluster_parser.set_defaults(run=cluster_command)
    bench_parser = commands.add_parser("bench", help="drive a Serving in process with closed-loop callers")
    bench_parser.add_argument("target", help="path/to/file.py:attr or package.module:attr (a Serving or a dict)")
    bench_parser.add_argument("--name", help="which model of a dict (default: the first)")
    bench_parser.add_argument("--callers", type=int, default=32, help="concurrent callers")
    bench_parser.add_argument("--seconds", type=float, default=5.0, help="how long to drive it")
    bench_parser.add_argument("--rows", type=int, default=1, help="rows per request")
    bench_parser.add_argument("--async", dest="use_async", action="store_true", help="asyncio callers, not threads")
    _add_overrides(bench_parser)
    bench_parser.set_defaults(run=bench_command)
    demo_parser = commands.add_parser("demo", help="softmax with every installed compiler vs numpy")
    demo_parser.add_argument("--budget", type=float, default=0.5, help="seconds of timing per cell")
    demo_parser.set_defaults(run=demo)
    commands.add_parser("devices", help="every device of every installed compiler").set_defaults(run=list_devices)
    mlir_parser = commands.add_parser("mlir", help="print the StableHLO of module:function")
    mlir_parser.add_argument("target", help="module:function, e.g. jitserve.workloads:softmax")
    mlir_parser.add_argument("--shape", type=_shape, default=(4,), help="input shape, e.g. 1000x1000x5")
    mlir_parser.add_argument("--dtype", default="float32")
    mlir_parser.set_defaults(run=mlir)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except JitserveError as error:  # a mistake in what was asked: one line, not a traceback
        if args.debug:
            raise
        print(f"jitserve {args.command}: {error}", file=sys.stderr)
        return 2
