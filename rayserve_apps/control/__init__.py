"""The control plane: what changes a running application.

- `controller.py`: the `PlacementController` deployment (AlpaServe re-placement, Arlo runtime re-allocation);
- `live_update.py`: declarative Serve config updates through Serve's REST API (the controller's fields merged into the
  deployed config) and reading them back;
- `runtime_allocations.py`: the controller's Arlo duty per polymorphing model (allocators, target tracking);
- `decision_log.py`: the controller's decisions, kept in the GCS;
- `cluster_fit.py`: the builder's check that a placement's groups fit the cluster's nodes.
"""
