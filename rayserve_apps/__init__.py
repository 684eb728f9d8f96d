"""Ray Serve glue: the app builder, the ingress, and the model deployments."""

from rayserve_apps.app import APP_NAME, build_app

__all__ = ["APP_NAME", "build_app"]
