"""Scale-out on a real two-raylet Ray cluster on loopback: reach by name from other processes, coalescing,
weighted routing, replica and raylet death, graceful stop, full queues, network fronts, clear errors.

Ray's settings (its own RAY_TMPDIR, token authentication) are set by this folder's conftest.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")
import ray_models  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import jitserve as js  # noqa: E402
from jitserve.cluster import ray as cluster  # noqa: E402
from jitserve.protocol.service import InferenceService  # noqa: E402
from netutil import free_port, front_processes, wait_ready  # noqa: E402
from waiting import HANG_S  # noqa: E402

pytestmark = pytest.mark.ray
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.fixture(scope="module")
def ray_cluster():
    """Head (resource node_a) and one worker raylet (node_b), both on 127.0.0.1, a short health check."""
    local = Cluster(initialize_head=True, head_node_args={
        "node_ip_address": "127.0.0.1", "num_cpus": 4, "resources": {"node_a": 100}, "include_dashboard": False,
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 4,
                           "health_check_initial_delay_ms": 0}})
    worker = local.add_node(node_ip_address="127.0.0.1", num_cpus=4, resources={"node_b": 100})
    local.wait_for_nodes()
    ray.init(address=local.address, log_to_driver=False)
    local.worker = worker
    yield local
    ray.shutdown()
    local.shutdown()
    shutil.rmtree(os.environ["RAY_TMPDIR"], ignore_errors=True)


def _rows(n, seed=0):
    return np.random.default_rng(seed).uniform(size=(n, 4)).astype(np.float32)


def _waiting(condition, seconds=HANG_S):
    """Wait until ``condition()`` holds or ``seconds`` pass (then the test's own assertions say what failed)."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def _load(name, callers, answers, during=None, rows=(1, 5), until=None):
    """Threads sending random requests until ``answers`` were answered and ``until()`` holds, if given
    (``during()`` called once after a third of the answers), bounded by HANG_S: (answered, wrong, errors)."""
    answered, wrong, errors = [0], [0], []
    lock = threading.Lock()
    stop = threading.Event()

    def caller(seed):
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            x = rng.uniform(size=(int(rng.integers(*rows)), 4)).astype(np.float32)
            try:
                out = js.batched_run(name, js.Batch.concatenate([x]), timeout=30)
            except Exception as error:
                with lock:
                    errors.append(f"{type(error).__name__}: {error}")
                continue
            with lock:
                answered[0] += 1
                wrong[0] += not np.array_equal(out, x * 2 + 1)

    threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(callers)]
    for thread in threads:
        thread.start()
    if during is not None:
        _waiting(lambda: answered[0] >= answers / 3)
        during()
    _waiting(lambda: answered[0] >= answers and (until is None or until()))
    stop.set()
    for thread in threads:
        thread.join(HANG_S)
        assert not thread.is_alive(), "a caller hung"
    return answered[0], wrong[0], errors


def _stop_and_check_gone(handle):
    handle.stop()
    assert not [n for n in cluster._actor_names(handle.name)]


def test_callers_in_two_other_processes_reach_replicas_on_both_nodes_with_full_batches(ray_cluster):
    handle = js.serve(ray_models.affine_serving, name="affine", cluster="ray", replicas=2)
    try:
        nodes = {ray.get(ray.get_actor(n, namespace="jitserve").info.remote())["node"] for n in handle.replicas}
        assert len(nodes) == 2, "replicas spread over both nodes"
        drivers = [subprocess.Popen([sys.executable, str(HERE / "ray_driver.py"), ray_cluster.address, "affine",
                                     "32", "3"], stdout=subprocess.PIPE, text=True) for _ in range(2)]
        results = [json.loads(d.communicate(timeout=120)[0].strip().splitlines()[-1]) for d in drivers]
        stats = handle.stats()
    finally:
        _stop_and_check_gone(handle)
    for result in results:
        assert result["requests"] > 100 and result["wrong"] == 0 and result["errors"] == []
    assert all(one.rows > 0 for one in stats.replicas.values()), "both replicas served"
    total = stats.total
    assert total.rows == sum(r["rows"] for r in results), "every row ran once"
    assert total.rows / total.batches >= 16 / 2, f"mean replica batch {total['rows'] / total['batches']:.1f}"


def test_weights_1_to_3_split_rows_within_15_percent(ray_cluster):
    light = js.serve(ray_models.instant_serving, name="weighted", cluster="ray", replicas=1, weight=1)
    heavy = js.serve(ray_models.instant_serving, name="weighted", cluster="ray", replicas=1, weight=3)
    try:
        x = js.Batch.concatenate([_rows(1)])
        for _ in range(2000):
            js.batched_run("weighted", x)
        rows = [light.stats().total.rows, heavy.stats().total.rows]
    finally:
        light.stop()
        heavy.stop()
    share = rows[0] / sum(rows)
    assert sum(rows) == 2000
    assert abs(share - 0.25) <= 0.15 * 0.25, f"light replica took {share:.3f} of the rows, expected 0.25"


def test_sigkill_of_a_replica_mid_load_loses_nothing(ray_cluster):
    handle = js.serve(ray_models.affine_serving, name="killed", cluster="ray", replicas=2)
    try:
        victim = ray.get(ray.get_actor(handle.replicas[0], namespace="jitserve").info.remote())["pid"]
        answered, wrong, errors = _load("killed", 16, 200, during=lambda: os.kill(victim, signal.SIGKILL))
    finally:
        handle.stop()
    assert errors == [] and wrong == 0 and answered > 100


def test_graceful_stop_mid_load_loses_nothing_and_runs_nothing_twice(ray_cluster, tmp_path):
    serving = ray_models.recording_serving(str(tmp_path))
    first = js.serve(serving, name="recorded", cluster="ray", replicas=1)
    second = js.serve(serving, name="recorded", cluster="ray", replicas=1)
    sent, wrong, errors = [], [0], []
    lock = threading.Lock()
    stop = threading.Event()

    def caller(k):
        n = 0
        while not stop.is_set():
            ids = np.arange(k * 100_000 + n + 1, k * 100_000 + n + 4, dtype=np.int32)[:, None]
            n += 3
            try:
                out = js.batched_run("recorded", js.Batch.concatenate([ids]), timeout=30)
            except Exception as error:
                errors.append(f"{type(error).__name__}: {error}")
                continue
            with lock:
                sent.extend(ids[:, 0].tolist())
                wrong[0] += not np.array_equal(out, ids * 2)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(16)]
    for thread in threads:
        thread.start()
    _waiting(lambda: len(list(tmp_path.glob("*.ids"))) == 2)  # both replicas ran rows
    first.stop()
    stopped_at = len(sent)
    _waiting(lambda: len(sent) >= stopped_at + 300)  # and the second one goes on alone
    stop.set()
    for thread in threads:
        thread.join(HANG_S)
    second.stop()
    ran = Counter(int(line) for file in tmp_path.glob("*.ids") for line in file.read_text().split())
    assert errors == [] and wrong[0] == 0
    assert len(list(tmp_path.glob("*.ids"))) == 2, "both replicas ran rows"
    assert set(ran) == set(sent), "every answered id ran, and nothing else"
    assert [i for i, count in ran.items() if count > 1] == [], "no id ran twice"


def test_a_full_queue_on_one_replica_is_served_by_the_other(ray_cluster):
    # every call carries 2 rows, more than the small queue ever holds: each one routed there spills over
    full = js.serve(ray_models.slow_serving(max_queue=1, batch_size=2), name="queues", cluster="ray", replicas=1,
                    resources={"node_a": 1})
    spare = js.serve(ray_models.slow_serving(max_queue=None, batch_size=2), name="queues", cluster="ray", replicas=1,
                     resources={"node_b": 1})
    try:
        answered, wrong, errors = _load("queues", 8, 8, rows=(2, 3), until=lambda: full.stats().total.rejected > 0)
        rejected = full.stats().total.rejected
    finally:
        full.stop()
        spare.stop()
    assert errors == [] and wrong == 0 and answered >= 8
    assert rejected > 0, "the small queue did fill up"


def test_every_replica_full_is_queue_full(ray_cluster):
    handle = js.serve(ray_models.slow_serving(max_queue=1), name="allfull", cluster="ray", replicas=1)
    try:
        answered, wrong, errors = _load("allfull", 6, 2, rows=(1, 2), until=lambda: handle.stats().total.rejected > 0)
    finally:
        handle.stop()
    assert wrong == 0 and answered >= 2
    assert errors and all(e == "QueueFullError: every replica of 'allfull' has a full queue (allfull/0)"
                          for e in errors)


def _cli(*args):
    return subprocess.Popen([sys.executable, "-m", "jitserve", *args], cwd=ROOT, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)


def test_serve_with_ray_and_a_front_in_another_process_answer_tritonclient(ray_cluster):
    """The front runs two HTTP front processes (``--http-workers 2``): their rows reach the Ray replicas
    through the front's engine as a one-process front's do."""
    import tritonclient.http as httpclient

    serve_port, front_port = free_port(), free_port()
    served = _cli("serve", "tests/cluster/ray_models.py:affine_serving", "--name", "netaffine", "--ray",
                  ray_cluster.address, "--replicas", "1", "--port", str(serve_port), "--no-grpc")
    front = None
    try:
        wait_ready(serve_port, served, 120)
        replica = cluster._actor_names("netaffine")
        assert replica == ["netaffine/0"]
        front = _cli("front", "--ray", ray_cluster.address, "--port", str(front_port), "--no-grpc",
                     "--http-workers", "2")
        wait_ready(front_port, front, 120)
        assert len(front_processes(front.pid)) == 2
        x = _rows(3, seed=5)
        for port in (serve_port, front_port):
            client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
            request = httpclient.InferInput("input", list(x.shape), "FP32")
            request.set_data_from_numpy(x)
            result = client.infer("netaffine", [request])
            np.testing.assert_array_equal(result.as_numpy("output"), x * 2 + 1)
        with urllib.request.urlopen(f"http://127.0.0.1:{front_port}/metrics", timeout=5) as response:
            metrics = response.read().decode()
        assert 'jitserve_replica_rows_total{model="netaffine",replica="netaffine/0",version="1"} 6.0' in metrics
    finally:
        for process in (front, served):
            if process is not None:
                process.send_signal(signal.SIGTERM)
                assert process.wait(60) == 0
    assert cluster._actor_names("netaffine") == [], "serve --ray stopped its replicas at exit"


def test_a_front_on_node_b_is_answered_by_a_replica_on_node_a(ray_cluster):
    import tritonclient.grpc as grpcclient

    handle = js.serve(ray_models.affine_serving, name="pinned", cluster="ray", replicas=1, resources={"node_a": 1})
    http_port, grpc_port = free_port(), free_port()
    front = _cli("front", "--ray", ray_cluster.address, "--models", "pinned", "--port", str(http_port),
                 "--grpc-port", str(grpc_port))
    try:
        info = ray.get(ray.get_actor("pinned/0", namespace="jitserve").info.remote())
        head = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "node_a" in n["Resources"])
        assert info["node"] == head
        wait_ready(http_port, front, 120)
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        x = _rows(2, seed=6)
        request = grpcclient.InferInput("input", list(x.shape), "FP32")
        request.set_data_from_numpy(x)
        np.testing.assert_array_equal(client.infer("pinned", [request]).as_numpy("output"), x * 2 + 1)
    finally:
        front.send_signal(signal.SIGTERM)
        assert front.wait(60) == 0
        handle.stop()


def test_bad_address_unknown_name_and_no_replicas_are_one_line_errors(ray_cluster):
    bad = subprocess.run([sys.executable, "-m", "jitserve", "serve", "examples/mlp.py:serving", "--ray",
                          "127.0.0.1:1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0
    assert bad.stderr.startswith("jitserve serve: cannot reach a Ray cluster at '127.0.0.1:1'")
    x = js.Batch.concatenate([_rows(1)])
    with pytest.raises(js.UnknownServerError, match=r"^no serving named 'nope' is running in the ray cluster$"):
        js.batched_run(("ray", "nope"), x)
    with pytest.raises(js.UnknownServerError,
                       match=r"^no server named 'nope' is running here \(running: none\), nor in the ray cluster$"):
        js.batched_run("nope", x)
    for options, message in [({"weight": float("nan")}, "weight must be a finite number > 0, got nan"),
                             ({"weight": 0}, "weight must be a finite number > 0, got 0"),
                             ({"replicas": True}, "replicas must be a non-negative integer, got True")]:
        with pytest.raises(js.OptionError) as info:
            js.serve(ray_models.instant_serving, name="refused", cluster="ray", **options)
        assert str(info.value) == message
    handle = js.serve(ray_models.instant_serving, name="emptied", cluster="ray", replicas=1)
    np.testing.assert_array_equal(js.batched_run("emptied", x), x.materialize() * 2 + 1)
    handle.scale(0)
    with pytest.raises(js.UnknownServerError, match=r"^no replica of 'emptied' is running in the ray cluster$"):
        js.batched_run("emptied", x, timeout=30)


def test_local_server_of_the_same_name_comes_first(ray_cluster):
    handle = js.serve(ray_models.instant_serving, name="both", cluster="ray", replicas=1)
    try:
        with js.serve(js.Serving(lambda x: x * 0, batch_size=4), name="both"):
            x = js.Batch.concatenate([_rows(2)])
            assert not js.batched_run("both", x).any(), "the local server answered"
            np.testing.assert_array_equal(js.batched_run(("ray", "both"), x), x.materialize() * 2 + 1)
    finally:
        handle.stop()


def test_preprocess_and_postprocess_run_once_in_the_caller_not_in_the_replica(ray_cluster):
    """The caller's coalescer runs them; the replica runs the batch as it comes (a replica that ran
    ``preprocess`` again would get a Batch instead of texts and fail)."""
    handle = js.serve(ray_models.text_serving, name="texts", cluster="ray", replicas=1)
    try:
        got = js.batched_run(("ray", "texts"), ["ab", "", "abcde"])
        assert got["doubled"].tolist() == [[4.0], [0.0], [10.0]]
        assert got["count"] == 3 and got["batches"] == 1
    finally:
        handle.stop()


def test_a_replica_with_200_mb_of_params_restarts_after_its_deploying_driver_exited(ray_cluster):
    """The weights live in the object store, owned by a detached holder actor; the replica's own constructor
    arguments are the serving without them, so Ray can restart it with no driver left."""
    done = subprocess.run([sys.executable, str(HERE / "ray_deploy.py"), ray_cluster.address, "heavy"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["heavy/0"]
    x = _rows(3)
    expected = x * 2 + np.array([1, 2, 3, 4], np.float32)
    try:
        np.testing.assert_array_equal(js.batched_run(("ray", "heavy"), js.Batch.concatenate([x])), expected)
        replica = ray.get_actor("heavy/0", namespace="jitserve")
        killed = ray.get(replica.info.remote())["pid"]
        os.kill(killed, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:  # Ray restarts the actor from its own record, and it fetches the weights again
            try:
                if ray.get(replica.info.remote(), timeout=10)["pid"] != killed:
                    break
            except Exception:
                assert time.monotonic() < deadline, "the replica was not restarted"
                time.sleep(0.5)
        np.testing.assert_array_equal(js.batched_run(("ray", "heavy"), js.Batch.concatenate([x]), timeout=60),
                                      expected)
    finally:
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry["name"].startswith("heavy/"):
                ray.kill(ray.get_actor(entry["name"], namespace=entry["namespace"]), no_restart=True)


def test_readme_scale_out_example_runs_in_another_driver(ray_cluster):
    import re

    example = next(code for code in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
                   if "ray.init" in code)
    done = subprocess.run([sys.executable, "-c", example], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "RAY_ADDRESS": ray_cluster.address})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "3 ['affine/0', 'affine/1']"
    assert cluster._actor_names("affine") == []


def test_sigkill_of_a_raylet_mid_load_loses_nothing(ray_cluster):
    survivor = js.serve(ray_models.affine_serving, name="raylet", cluster="ray", replicas=1,
                        resources={"node_a": 1}, max_restarts=0)
    doomed = js.serve(ray_models.affine_serving, name="raylet", cluster="ray", replicas=1,
                      resources={"node_b": 1}, max_restarts=0)
    try:
        answered, wrong, errors = _load(
            "raylet", 16, 300, during=lambda: ray_cluster.remove_node(ray_cluster.worker, allow_graceful=False))
        survived = survivor.stats().total.rows
    finally:
        survivor.stop()
        doomed.stop()  # its replica died with its node: nothing to drain
    assert errors == [] and wrong == 0 and answered > 100
    assert survived > 0


def test_a_text_generation_on_ray_answers_the_pieces_of_a_local_server(ray_cluster):
    """Its preprocess and postprocess come from a module of their own (ray_text), which travels to the
    replica by value as the generation's functions do; they run in the caller."""
    import ray_text

    with js.serve(ray_text.generation(), name="text-local"):
        local = js.generate("text-local", "héllo", max_steps=6).tolist()
    handle = js.serve(ray_text.generation(), name="text", cluster="ray", replicas=1)
    try:
        assert js.generate(("ray", "text"), "héllo", max_steps=6).tolist() == local
        assert list(js.generate_stream(("ray", "text"), "héllo", max_steps=6)) == local
    finally:
        handle.stop()


def test_a_generation_on_two_replicas_streams_samples_and_frees_slots(ray_cluster):
    """Each replica owns its slots; callers are routed by load; a request's tokens are those of a local
    server (greedy and seeded sampling alike, penalized, with log-probabilities); a caller that stops reading
    frees its slot."""
    prompts = [np.array([index + 1, 2, 3], np.int32) for index in range(12)]
    with js.serve(ray_models.generation(slots=2), name="gen-local") as local:
        greedy = [js.generate("gen-local", prompt, max_steps=10).tolist() for prompt in prompts]
        sampled = js.generate("gen-local", prompts[0], max_steps=10, temperature=1.5, seed=4).tolist()
        scored, logprobs = js.generate("gen-local", prompts[3], max_steps=6, repetition_penalty=1.5, logprobs=2)
        assert local.stats().compiles > 0
    handle = js.serve(ray_models.generation(slots=2), name="gen", cluster="ray", replicas=2)
    try:
        results: dict[int, list[int]] = {}

        def call(index):
            results[index] = js.generate(("ray", "gen"), prompts[index], max_steps=10).tolist()

        threads = [threading.Thread(target=call, args=(index,)) for index in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert [results[index] for index in range(len(prompts))] == greedy
        assert js.generate(("ray", "gen"), prompts[0], max_steps=10, temperature=1.5, seed=4).tolist() == sampled
        remote, remote_logprobs = js.generate(("ray", "gen"), prompts[3], max_steps=6, repetition_penalty=1.5,
                                              logprobs=2)
        assert remote.tolist() == scored.tolist() and remote_logprobs == logprobs, "penalties and log-probabilities"
        per_replica = handle.stats().replicas
        assert sorted(per_replica) == ["gen/0", "gen/1"]
        assert all(stats.requests > 0 for stats in per_replica.values()), per_replica
        stream = js.generate_stream(("ray", "gen"), prompts[1], max_steps=60)
        assert int(next(stream)) == greedy[1][0]
        stream.close()
        _waiting(lambda: not any(s.slots_busy for s in handle.stats().replicas.values()))
        assert not any(s.slots_busy for s in handle.stats().replicas.values()), "the slot was freed"
        with pytest.raises(js.PromptTooLongError, match="the prompt has 9 tokens, more than the longest prefill "
                                                        "length \\(8; max_length is 64\\)"):
            js.generate(("ray", "gen"), np.arange(1, 10), max_steps=2)
        service = InferenceService({"gen": js.serving.lookup(("ray", "gen"))})  # what jitserve front serves
        _, outputs = asyncio.run(service.infer("gen", {"prompt": prompts[2]}, None, parameters={"max_steps": 4}))
        assert outputs[0][0] == "output" and outputs[0][1].tolist() == greedy[2][:4]
    finally:
        _stop_and_check_gone(handle)


# operations: list, stop, adopt, a front that follows the cluster ---------------------------------------------

def _run_cli(*args):
    done = subprocess.run([sys.executable, "-m", "jitserve", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _states(name):
    return {row["replica"]: row for row in cluster.describe() if row["serving"] == name}


def _until(condition, seconds=HANG_S):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.25)


def test_a_restarted_serve_adopts_its_replicas_after_sigkill_and_list_stop_report_them(ray_cluster):
    import tritonclient.http as httpclient

    serve = ("serve", "tests/cluster/ray_models.py:affine_serving", "--name", "adoptee", "--ray", ray_cluster.address,
             "--replicas", "2", "--no-grpc", "--port")
    first_port, second_port = free_port(), free_port()
    first = _cli(*serve, str(first_port))
    second = None
    try:
        wait_ready(first_port, first, 120)
        listed = _run_cli("cluster", "list", "--ray", ray_cluster.address)
        assert listed.splitlines()[0].split() == ["SERVING", "REPLICA", "NODE", "PID", "OWNER", "STATE"]
        rows = [line.split() for line in listed.splitlines()[1:] if line.startswith("adoptee ")]
        assert [(row[1], row[4].startswith("owner-"), row[5]) for row in rows] == [
            ("adoptee/0", True, "ready"), ("adoptee/1", True, "ready")]
        pids = {row["pid"] for row in _states("adoptee").values()}
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        _until(lambda: {row["state"] for row in _states("adoptee").values()} == {"stale"})
        assert "2 stale replicas (their owner is gone)" in _run_cli("cluster", "list", "--ray", ray_cluster.address)

        started = time.monotonic()
        second = _cli(*serve, str(second_port))
        wait_ready(second_port, second, 120)
        print(f"a restarted serve --ray was ready in {time.monotonic() - started:.1f} s, adopting 2 replicas")
        states = _states("adoptee")
        assert sorted(states) == ["adoptee/0", "adoptee/1"], "adopted, not doubled"
        assert {row["state"] for row in states.values()} == {"ready"}
        assert {row["pid"] for row in states.values()} == pids, "the same replica processes, not new ones"
        x = _rows(3, seed=9)
        client = httpclient.InferenceServerClient(f"127.0.0.1:{second_port}")
        request = httpclient.InferInput("input", list(x.shape), "FP32")
        request.set_data_from_numpy(x)
        np.testing.assert_array_equal(client.infer("adoptee", [request]).as_numpy("output"), x * 2 + 1)
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                assert process.wait(60) == 0
    assert second is not None and "adopted 2 replicas of 'adoptee' whose owner is gone" in second.stderr.read()
    assert cluster._actor_names("adoptee") == [], "the adopting process stopped them at exit"


def test_cluster_stop_by_name_and_the_stale(ray_cluster):
    handle = js.serve(ray_models.instant_serving, name="detached", cluster="ray", replicas=1)  # no owner
    port = free_port()
    owned = _cli("serve", "tests/cluster/ray_models.py:instant_serving", "--name", "orphan", "--ray",
                 ray_cluster.address, "--no-grpc", "--port", str(port))
    try:
        wait_ready(port, owned, 120)
        assert _states("detached")["detached/0"]["owner"] == "(detached)"
        owned.send_signal(signal.SIGKILL)
        owned.wait(30)
        _until(lambda: _states("orphan")["orphan/0"]["state"] == "stale")
        assert _run_cli("cluster", "stop", "--stale", "--ray", ray_cluster.address) == "stopped 1 replicas: orphan/0\n"
        assert cluster._actor_names("orphan") == [] and cluster._actor_names("detached") == ["detached/0"]
        assert _run_cli("cluster", "stop", "detached", "--ray", ray_cluster.address) == \
            "stopped 1 replicas: detached/0\n"
        assert cluster._actor_names("detached") == []
    finally:
        handle.stop()


def test_a_front_serves_what_is_deployed_after_it_and_forgets_what_stops(ray_cluster):
    port = free_port()
    front = _cli("front", "--ray", ray_cluster.address, "--models", "latecomer", "--port", str(port), "--no-grpc")
    handle = None
    try:
        wait_ready(port, front, 120)

        def status():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/latecomer/ready", timeout=5) as r:
                    return r.status
            except urllib.error.HTTPError as error:
                return error.code

        assert status() == 404
        handle = js.serve(ray_models.instant_serving, name="latecomer", cluster="ray", replicas=1)
        _until(lambda: status() == 200)
        x = _rows(2, seed=3)
        body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [2, 4],
                                       "data": x.ravel().tolist()}]}).encode()
        with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/latecomer/infer",
                                                           body), timeout=30) as response:
            answer = json.loads(response.read())
        np.testing.assert_allclose(np.array(answer["outputs"][0]["data"]).reshape(2, 4), x * 2 + 1, rtol=1e-6)
        handle.stop()
        handle = None
        _until(lambda: status() == 404)
    finally:
        if handle is not None:
            handle.stop()
        front.send_signal(signal.SIGTERM)
        assert front.wait(60) == 0


def test_a_wrong_token_is_one_line_naming_what_to_do(ray_cluster, tmp_path):
    wrong = tmp_path / "auth_token"
    wrong.write_text(secrets.token_hex(32))
    done = subprocess.run([sys.executable, "-m", "jitserve", "cluster", "list", "--ray", ray_cluster.address],
                          cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "RAY_AUTH_TOKEN_PATH": str(wrong)})
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"jitserve cluster: the Ray cluster at '{ray_cluster.address}' did not accept this "
                                  f"process")
    assert f"{wrong} holds another one (a stale token of an earlier cluster?)" in done.stderr


def test_autoscaling_goes_from_1_to_3_replicas_under_load_and_back_to_1_when_idle(ray_cluster):
    policy = cluster.Autoscaling(min_replicas=1, max_replicas=3, target_queue=0.5, upscale_delay_s=0.5,
                                 downscale_delay_s=2.0)
    handle = js.serve(ray_models.slow_serving(None), name="elastic", cluster="ray", autoscaling=policy)
    try:
        assert handle.replicas == ["elastic/0"]
        loaded = time.monotonic()
        answered, wrong, errors = _load("elastic", callers=8, answers=1, rows=(1, 2),
                                        until=lambda: len(handle.replicas) == 3)
        unloaded = time.monotonic()
        assert not errors and not wrong and answered > 0
        _until(lambda: len(handle.replicas) == 1)
        events = handle.autoscaler.events
        ups = [event for event in events if event[2] > event[1]]
        downs = [event for event in events if event[2] < event[1]]
        assert ups and ups[-1][2] == 3 and downs and downs[0][1] == 3 and downs[-1][2] == 1, events
        assert events == ups + downs, f"up while loaded, then down once idle, never back and forth: {events}"
        started = handle.autoscaler._started
        print(f"autoscaling: decided on 3 replicas {started + ups[-1][0] - loaded:.1f} s after the load began, "
              f"on 1 {started + downs[-1][0] - unloaded:.1f} s after it ended: {events}")
    finally:
        handle.stop()
    assert cluster._actor_names("elastic") == []


def test_a_streaming_serving_on_two_replicas_streams_each_caller_its_steps(ray_cluster):
    handle = js.serve(ray_models.stepping_serving, name="stepper", cluster="ray", replicas=2)
    try:
        results, errors = {}, []

        def caller(seed):
            x = _rows(1 + seed % 3, seed=seed)
            try:
                results[seed] = (x, list(js.batched_stream(("ray", "stepper"), js.Batch.concatenate([x]), timeout=30)))
            except Exception as error:
                errors.append(error)

        threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors and len(results) == 12
        for x, steps in results.values():
            assert len(steps) == 3
            for step, outputs in enumerate(steps, 1):
                np.testing.assert_array_equal(outputs, x + step)
        rows_per_replica = {name: stats.rows for name, stats in handle.stats().replicas.items()}
        assert sum(rows_per_replica.values()) == sum(len(x) for x, _ in results.values())
        early = js.batched_stream(("ray", "stepper"), js.Batch.concatenate([_rows(1)]), timeout=30)
        assert next(early).shape == (1, 4)
        early.close()  # cancels the replica's run at its next step
        _until(lambda: handle.stats().total.cancelled >= 1)
    finally:
        handle.stop()
