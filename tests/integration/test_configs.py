"""The shipped configs are valid: every Serve config's plexserve spec parses, and the dashboard names our metrics."""

import json
import re
from pathlib import Path

import pytest
import yaml
from repo_paths import REPO_ROOT

from placement.core.deployment_spec import parse_spec
from rayserve_apps.contracts import APP_IMPORT_PATH

CONFIGS = REPO_ROOT / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_serve_config_carries_a_valid_spec(path):
    config = yaml.safe_load(path.read_text())
    apps = [app for app in config["applications"] if app["import_path"] == APP_IMPORT_PATH]
    assert apps, f"{path.name} has no plexserve application"
    for app in apps:
        spec = parse_spec(app["args"])
        assert spec.models


def test_grafana_dashboard_charts_every_plexserve_metric():
    import rayserve_apps.metrics
    import rayserve_apps.replicas.vision  # the OTAS metrics

    sources = (rayserve_apps.metrics.__file__, rayserve_apps.replicas.vision.__file__)
    defined = set(re.findall(r'"(plexserve_[a-z_]+)"', " ".join(Path(source).read_text() for source in sources)))
    dashboard = json.loads((CONFIGS / "grafana-plexserve.json").read_text())
    exprs = " ".join(target["expr"] for panel in dashboard["panels"] for target in panel["targets"])
    uncharted = sorted(name for name in defined if f"ray_{name}" not in exprs)
    assert defined and not uncharted, f"metrics without a dashboard panel: {uncharted}"
