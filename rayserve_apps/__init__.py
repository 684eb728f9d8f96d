"""Ray Serve glue: the app builder (`app.py`, `rayserve_apps.app:build_app`), the ingress, the model deployments,
their routers and the placement controller.

Importing the package loads nothing else: `import rayserve_apps.metrics` pulls in neither the app nor torch.
"""
