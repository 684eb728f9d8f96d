"""Device groups land on nodes that have their devices; a placement that cannot fit is refused up front.

A three-node Ray cluster on this machine (`ray.cluster_utils.Cluster`): a head without devices, a node with two
logical devices and a node with one. Tiny ViTs (random weights saved to local checkpoints, code-path stand-ins)
keep the test light.
"""

import numpy as np
import pytest
import torch
from conftest import TEST_DEVICE_RESOURCE
from ray import serve

from models import load_vit
from placement.core.deployment_spec import parse_spec
from rayserve_apps.app import build_app
from rayserve_apps.contracts import APP_NAME
from rayserve_apps.control.cluster_fit import check_placement_fits

pytestmark = pytest.mark.ray

TINY_VIT = dict(patch_size=4, depth=2, embed_dim=32, num_heads=2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    two = cluster.add_node(num_cpus=2, resources={TEST_DEVICE_RESOURCE: 2})
    one = cluster.add_node(num_cpus=2, resources={TEST_DEVICE_RESOURCE: 1})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    vit = load_vit("timm:vit_tiny_patch16_224", allow_random_init=True, num_classes=3, image_size_px=16, **TINY_VIT)
    checkpoint = tmp_path_factory.mktemp("vit") / "vit.pt"
    torch.save(vit.model.state_dict(), checkpoint)
    try:
        yield {"two": two.node_id, "one": one.node_id, "checkpoint": str(checkpoint), "vit": vit}
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def spec_for(checkpoint: str, group_sizes: list[int]):
    models = [{"name": f"vit-{i}", "kind": "vision", "source": "timm:vit_tiny_patch16_224",
               "checkpoint_path": checkpoint,
               "num_classes": 3, "image_size_px": 16, "timm_kwargs": TINY_VIT, "num_cpus_per_replica": 0.25}
              for i in range(len(group_sizes))]
    groups = [{"num_devices": n, "config": {"pipeline_stages": n}, "models": [f"vit-{i}"]}
              for i, n in enumerate(group_sizes)]
    return parse_spec({"cluster": {"num_devices": sum(group_sizes), "device_resource": TEST_DEVICE_RESOURCE},
                       "models": models, "placement": {"groups": groups}})


def test_groups_land_on_nodes_with_their_devices(cluster):
    spec = spec_for(cluster["checkpoint"], [2, 1])
    assert check_placement_fits(spec, [2, 1]) == {0: cluster["two"], 1: cluster["one"]}
    handle = serve.run(build_app(spec), name=APP_NAME, route_prefix=None, blocking=False)
    info0 = serve.get_deployment_handle("group-0", app_name=APP_NAME).info.remote().result(timeout_s=120)
    info1 = serve.get_deployment_handle("group-1", app_name=APP_NAME).info.remote().result(timeout_s=120)
    assert info0["node_id"] == cluster["two"]
    assert info1["node_id"] == cluster["one"]
    images = np.random.default_rng(0).normal(size=(2, 3, 16, 16)).astype(np.float32)
    expected = torch.softmax(cluster["vit"].logits(torch.from_numpy(images)), dim=-1).numpy()
    for model in ("vit-0", "vit-1"):
        body = handle.classify.remote(model, images.tolist()).result(timeout_s=120)
        assert np.allclose([p["probabilities"] for p in body["predictions"]], expected, atol=1e-5)
    serve.delete(APP_NAME)


def test_placement_that_does_not_fit_is_refused_before_deploying(cluster):
    too_big = spec_for(cluster["checkpoint"], [3])  # no node has three devices
    with pytest.raises(ValueError,
                       match=r"placement\.groups\.0 needs 3 'plex_device' on one node.*\[2\.0, 1\.0, 0\.0\]"):
        build_app(too_big)
    two_pairs = spec_for(cluster["checkpoint"], [2, 2])  # three devices in all, but not two pairs on single nodes
    with pytest.raises(ValueError, match=r"placement\.groups\.1 needs 2"):
        build_app(two_pairs)
    assert APP_NAME not in serve.status().applications
