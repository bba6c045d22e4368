"""A deploying driver that exits: serves ray_models.weights_serving() as NAME on the cluster at ADDRESS with one
replica, prints its replicas as JSON, and ends without stopping them (they are detached)."""

from __future__ import annotations

import json
import sys

import ray
import ray_models

import jitserve as js

if __name__ == "__main__":
    ray.init(address=sys.argv[1], log_to_driver=False)
    handle = js.serve(ray_models.weights_serving(), name=sys.argv[2], cluster="ray", replicas=1)
    print(json.dumps(handle.replicas), flush=True)
