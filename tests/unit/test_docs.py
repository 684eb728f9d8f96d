"""The README and the docs site: links resolve inside the repository, generated pages are fresh, every spec field
is described, and benchmarks keep their figures as result files. No Ray is started."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from repo_paths import REPO_ROOT

ROOT = REPO_ROOT
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


@pytest.fixture(scope="module")
def gen_docs():
    spec = importlib.util.spec_from_file_location("plexserve_gen_docs", ROOT / "docs" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def relative_links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    return [target for target in LINK.findall(text)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target) and not target.startswith("#")]


def test_every_relative_link_resolves_inside_the_repository():
    broken = []
    for path in markdown_files():
        for target in relative_links(path):
            resolved = (path.parent / target.split("#", 1)[0]).resolve()
            if not resolved.is_relative_to(ROOT) or not resolved.exists():
                broken.append(f"{path.relative_to(ROOT)} -> {target}")
    assert not broken, "links that point at nothing in the repository: " + ", ".join(broken)


def test_the_link_check_finds_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[ok](https://example.org) [design](design.md#x) `[no](code.md)`\n```\n[no](fenced.md)\n```\n")
    assert relative_links(page) == ["design.md#x"]


def test_readme_is_short_and_points_only_inside_the_repository():
    text = (ROOT / "README.md").read_text()
    assert len(text) <= 15_000
    assert "../" not in text, "the README points outside the repository"
    first = [line.strip() for line in text.splitlines() if line.strip()][1:3]
    assert first[0].startswith("make serve") and first[1].startswith("make test")


def test_every_spec_field_has_a_description(gen_docs):
    missing = [f"{model}.{field}" for model, field, info in gen_docs.spec_fields() if not (info.description or "")]
    assert not missing, "spec fields without a description: " + ", ".join(missing)


def test_generated_pages_are_not_stale(gen_docs):
    stale = gen_docs.stale_pages()
    assert not stale, f"stale generated pages (run python docs/gen_docs.py): {stale}"


def test_configuration_page_lists_every_field_with_its_unit(gen_docs):
    page = gen_docs.configuration_page()
    for model, field, _ in gen_docs.spec_fields():
        assert f"`{field}`" in page, f"{model}.{field} is not on the configuration page"
    assert "| `slo_ms` | float (> 0) | `1000.0` | milliseconds |" in page


def test_metrics_page_reads_every_metric_from_the_source(gen_docs):
    names = {metric["name"] for metric in gen_docs.metric_definitions()}
    assert {"plexserve_requests_total", "plexserve_request_latency_ms", "plexserve_otas_batches_total"} <= names
    latency = next(m for m in gen_docs.metric_definitions() if m["name"] == "plexserve_request_latency_ms")
    assert latency["kind"] == "Histogram" and latency["tag_keys"] == ["model"] and latency["boundaries"][0] == 1


def test_every_benchmark_result_file_names_its_run(gen_docs):
    names = {path.stem for path in gen_docs.benchmark_modules()}
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        record = json.loads(path.read_text())
        assert {"benchmark", "machine", "date", "commit", "command", "quick", "figures"} <= set(record), path.name
        if path.stem == "device_check":  # the GPU check is a shell script of steps, not a benchmark module
            assert record["command"] == "bash benchmarks/device_check.sh" and record["benchmark"] == path.stem
            assert (ROOT / "benchmarks" / "device_check.sh").is_file()
            continue
        module = record["command"].split()[2].removeprefix("benchmarks.")
        assert record["command"].startswith(f"python -m benchmarks.{module}"), path.name
        assert module in names and path.stem.startswith(module), f"{path.name} belongs to no benchmark"
        assert record["benchmark"] == path.stem


def test_emit_json_keeps_the_figures_in_a_result_file(tmp_path, monkeypatch, capsys):
    from benchmarks import _common

    monkeypatch.setattr(_common, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr("sys.argv", [str(ROOT / "benchmarks" / "some_bench.py"), "--quick"])
    _common.emit_json({"ratio": 1.5, "nan": float("nan")})
    assert json.loads(capsys.readouterr().out) == {"nan": None, "ratio": 1.5}
    record = json.loads((tmp_path / "some_bench.json").read_text())
    assert record["benchmark"] == "some_bench" and record["quick"] is True
    assert record["command"] == "python -m benchmarks.some_bench --quick"
    assert record["figures"] == {"nan": None, "ratio": 1.5}
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?|unknown", record["commit"])
    assert record["date"].endswith("+00:00")


def test_result_files_record_paths_inside_the_repository_relative_to_it(tmp_path, monkeypatch, capsys):
    from benchmarks import _common

    monkeypatch.setattr(_common, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr("sys.argv", [str(ROOT / "benchmarks" / "some_bench.py")])
    _common.emit_json({"png": str(_common.OUT_DIR / "some_bench.png"), "elsewhere": "/etc/hosts"})
    record = json.loads((tmp_path / "some_bench.json").read_text())
    assert record["figures"] == {"png": "benchmarks/out/some_bench.png", "elsewhere": "/etc/hosts"}

    def strings(value):
        if isinstance(value, dict):
            return [s for item in value.values() for s in strings(item)]
        if isinstance(value, list):
            return [s for item in value for s in strings(item)]
        return [value] if isinstance(value, str) else []

    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        figures = json.loads(path.read_text())["figures"]
        assert not [s for s in strings(figures) if s.endswith(".png") and s.startswith("/")], path.name


def test_check_names_a_page_that_differs_from_what_it_would_write(gen_docs, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gen_docs, "DOCS", tmp_path)
    (tmp_path / "fresh.md").write_text("same\n")
    (tmp_path / "old.md").write_text("before\n")
    pages = {"fresh.md": lambda: "same\n", "old.md": lambda: "after\n", "absent.md": lambda: "new\n"}
    assert gen_docs.stale_pages(pages) == ["old.md", "absent.md"]
    monkeypatch.setattr(gen_docs, "PAGES", pages)
    assert gen_docs.main(["--check"]) == 1
    assert "docs/old.md is stale" in capsys.readouterr().err


def test_many_models_cpu_table_lists_each_role_per_system_and_rate(gen_docs):
    point = {"rate_per_s": 10.0, "cpu": {"busy_cores": 0.5, "ms_per_request": {
        "models": 30.0, "group_replicas": 7.0, "ingress": 6.0, "load_generator": 1.0, "other": 6.0}}}
    table = gen_docs.many_models_cpu_table({"plexserve": [point], "serve_deployments": [{"rate_per_s": 10.0}]})
    rows = [line for line in table.splitlines() if line.startswith("| plexserve")]
    assert rows == ["| plexserve | 10 | 0.5 | 30 | 7 | 6 | 1 | 6 | 50 |"]
    assert "serve_deployments" not in table  # a point without CPU readings has no row
    assert gen_docs.many_models_cpu_table({"plexserve": [{"rate_per_s": 10.0}]}) == ""
