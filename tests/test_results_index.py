"""`fedapps report ROOT --html` on a folder of results: a real run, comparison and tuning (digits, in-process, ~20 s)
indexed on one page whose numbers are the folders' own, linked to each folder's report (a tuning gets one too),
sorted by its inline script in a headless Chromium (skipped without one, as the run report's browser test)."""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path

import pytest

from conftest import write_config
from fedapps_tools import cli
from fedapps_tools.results_index import result_folders
from test_html_report import Page, browser, run_browser


class IndexPage(Page):
    """:class:`Page` and the page's links."""

    def __init__(self, text: str) -> None:
        self.links: list[str] = []
        super().__init__(text)

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.links.append(dict(attrs).get("href") or "")
        super().handle_starttag(tag, attrs)


DIGITS = {"data": {"source": "digits", "partition": "iid", "num_clients": 3}}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    """results/: one run, one comparison (FedAvg and Local, seeds 0 and 1), one tuning (2 learning rates), one folder
    whose summary.json is broken."""
    root = tmp_path_factory.mktemp("results-index")
    out = root / "results"
    fedavg = write_config(root / "fedavg.yaml", **DIGITS)
    local = write_config(root / "local.yaml", strategy={"name": "local"}, **DIGITS)
    common = ["--engine", "inprocess", "--output-dir", str(out), "--quiet"]
    assert cli.main(["run", str(fedavg), "--set", "run_name=fedavg-digits-iid-s0", *common]) == 0  # a fixed name
    assert cli.main(["compare", str(fedavg), str(local), "--seeds", "0", "1", "--name", "cmp", *common]) == 0
    assert cli.main(["tune", str(fedavg), "--grid", "client.lr=0.01,0.1", "--name", "tune-fedavg", *common]) == 0
    broken = out / "nested" / "broken"
    broken.mkdir(parents=True)
    (broken / "summary.json").write_text("{not json")
    return out


def body_rows(page: Page) -> list[dict[str, str]]:
    header, *rows = page.tables["index"]
    return [dict(zip(header, r)) for r in rows]


def test_every_folder_is_indexed_with_its_own_numbers_and_a_link_to_its_report(results, capsys):
    assert [(k, p.relative_to(results).as_posix()) for k, p in result_folders(results)] == [
        ("comparison", "cmp"),
        ("run", "fedavg-digits-iid-s0"),
        ("run", "nested/broken"),
        ("tune", "tune-fedavg"),
    ]
    assert cli.main(["report", str(results), "--html"]) == 0
    captured = capsys.readouterr()
    index = results / "index.html"
    assert f"report: {index} (index of 3 result folders" in captured.out
    assert "not indexed" in captured.err and "broken" in captured.err
    text = index.read_text()
    assert "http://" not in text and "https://" not in text and "<link" not in text and " src=" not in text
    page = IndexPage(text)
    rows = body_rows(page)
    assert [(r["kind"], r["folder"]) for r in rows] == [
        ("comparison", "cmp"),
        ("comparison", "cmp"),
        ("run", "fedavg-digits-iid-s0"),
        ("tune", "tune-fedavg"),
        ("tune", "tune-fedavg"),
    ]
    # the comparison's rows are comparison.csv's (mean and SEM over the two seeds)
    with (results / "cmp" / "comparison.csv").open() as fh:
        table = {r["config"]: r for r in csv.DictReader(fh)}
    for row in rows[:2]:
        want = table[row["config"]]
        assert row["strategy"] == want["strategy"] and row["seeds"] == "0, 1"
        assert row["accuracy"] == f"{float(want['accuracy_mean']):.4f}"
        assert row["± SEM"] == f"{float(want['accuracy_mean_sem']):.4f}"
        assert row["split"] == "test" and row["setting"] == "digits iid, 3 clients" and row["rounds"] == "2"
    # the run's row is its summary's headline; one seed: no SEM
    summary = json.loads((results / "fedavg-digits-iid-s0" / "summary.json").read_text())
    assert rows[2]["accuracy"] == f"{summary['accuracy_mean']:.4f}" and rows[2]["± SEM"] == "-"
    assert rows[2]["seeds"] == "0" and rows[2]["strategy"] == "fedavg"
    # the tuning's rows: one per grid point, on the validation split, as tuning.csv recorded them
    with (results / "tune-fedavg" / "tuning.csv").open() as fh:
        points = list(csv.DictReader(fh))
    assert [r["config"] for r in rows[3:]] == ["p1: client.lr=0.01", "p2: client.lr=0.1"]
    assert [r["accuracy"] for r in rows[3:]] == [f"{float(p['val_accuracy_mean']):.4f}" for p in points]
    assert {r["split"] for r in rows[3:]} == {"validation"}
    # every row links to its folder's report, which exists
    links = [a for a in page.links if a.endswith("report.html")]
    assert sorted(set(links)) == ["cmp/report.html", "fedavg-digits-iid-s0/report.html", "tune-fedavg/report.html"]
    assert all((results / a).is_file() for a in links)


def test_reports_are_rewritten_only_when_the_results_are_newer(results, capsys):
    assert cli.main(["report", str(results), "--html"]) == 0
    run_page = results / "fedavg-digits-iid-s0" / "report.html"
    cmp_page = results / "cmp" / "report.html"
    before = run_page.stat().st_mtime_ns, cmp_page.stat().st_mtime_ns
    summary = results / "fedavg-digits-iid-s0" / "summary.json"
    later = run_page.stat().st_mtime + 10
    os.utime(summary, (later, later))
    assert cli.main(["report", str(results), "--html"]) == 0
    assert run_page.stat().st_mtime_ns != before[0]  # stale: written again
    assert cmp_page.stat().st_mtime_ns == before[1]  # current: left alone
    capsys.readouterr()


def test_a_tune_folder_has_its_own_report(results, tmp_path, capsys):
    tune = results / "tune-fedavg"
    out = tmp_path / "tune.html"
    assert cli.main(["report", str(tune), "--html", "--out", str(out)]) == 0
    page = IndexPage(out.read_text())
    header, *rows = page.tables["results"]
    assert [r[:3] for r in rows] == [["p1: client.lr=0.01", "fedavg", "1"], ["p2: client.lr=0.1", "fedavg", "1"]]
    assert all("validation split" in r[-1] for r in rows)
    assert "Tuning folder" in out.read_text()
    capsys.readouterr()
    assert cli.main(["report", str(tune)]) == 0
    assert capsys.readouterr().out == (tune / "tuning.md").read_text()
    # without --html a folder of results prints the index as text
    assert cli.main(["report", str(results)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith(("run ", "comparison ", "tune ")) for line in lines) == 5


def test_an_empty_folder_is_refused(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path), "--html"]) == 2
    assert "no run, comparison or tune folder found" in capsys.readouterr().err


def test_the_index_sorts_in_a_browser(results, tmp_path, capsys):
    assert cli.main(["report", str(results), "--html"]) == 0
    capsys.readouterr()
    index = results / "index.html"
    exe = browser()
    static = [r["accuracy"] for r in body_rows(IndexPage(index.read_text()))]
    shown = [r["accuracy"] for r in body_rows(IndexPage(run_browser(exe, tmp_path, "--dump-dom", index.as_uri())))]
    assert shown == static  # no sort asked: the order written
    for direction, reverse in (("asc", False), ("desc", True)):
        dom = IndexPage(run_browser(exe, tmp_path, "--dump-dom", index.as_uri() + f"#sort=accuracy:{direction}"))
        got = [float(r["accuracy"]) for r in body_rows(dom)]
        assert got == sorted((float(a) for a in static), reverse=reverse), direction
        assert all(math.isfinite(x) for x in got)
    # text columns sort by their text
    dom = IndexPage(run_browser(exe, tmp_path, "--dump-dom", index.as_uri() + "#sort=kind:desc"))
    assert [r["kind"] for r in body_rows(dom)] == ["tune", "tune", "run", "comparison", "comparison"]


NODE_SHIM = r"""
const fs = require('fs');
function el(attrs, cls) {
  return { attrs: Object.assign({}, attrs), getAttribute(k) { return k in this.attrs ? this.attrs[k] : null; },
    setAttribute(k, v) { this.attrs[k] = String(v); }, removeAttribute(k) { delete this.attrs[k]; },
    classList: { contains: (c) => c === cls }, addEventListener(e, f) { this.click = f; } };
}
const head = [el({'data-column': 'kind'}, 'txt'), el({'data-column': 'accuracy'}, 'num')];
const data = [['run', '0.5'], ['tune', ''], ['comparison', '0.9'], ['comparison', '0.1']];
const rows = data.map(r => ({ cells: r.map(v => el({'data-sort': v})), label: r.join('/') }));
const body = { rows: rows.slice(), appendChild(r) { this.rows.splice(this.rows.indexOf(r), 1); this.rows.push(r); } };
global.document = { getElementById: () => ({ tHead: { rows: [{ cells: head }] }, tBodies: [body] }) };
global.window = { location: { hash: process.argv[3] } };
eval(fs.readFileSync(process.argv[2], 'utf8'));
const order = () => body.rows.map(r => r.label).join(' ');
const out = [order()];
head[0].click(); out.push(order());
head[0].click(); out.push(order());
console.log(JSON.stringify(out));
"""


def test_the_sort_script_where_node_is_installed(tmp_path):
    """The page's script on a stand-in for the DOM (where there is no Chromium, Node.js still runs it): #sort= sorts
    numbers by value with empty cells last, a header click sorts by text and a second click the other way."""
    import shutil
    import subprocess

    from fedapps_tools.results_index import SCRIPT

    node = shutil.which("node")
    if node is None:
        pytest.skip("no node on PATH: the browser test above checks the script where Chromium is installed")
    (tmp_path / "script.js").write_text(SCRIPT)
    (tmp_path / "shim.js").write_text(NODE_SHIM)

    def orders(hash_: str) -> list[str]:
        proc = subprocess.run(
            [node, str(tmp_path / "shim.js"), str(tmp_path / "script.js"), hash_],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    assert orders("#sort=accuracy:desc")[0] == "comparison/0.9 run/0.5 comparison/0.1 tune/"
    assert orders("#sort=accuracy")[0] == "comparison/0.1 run/0.5 comparison/0.9 tune/"
    unsorted, by_kind, by_kind_desc = orders("")
    assert unsorted == "run/0.5 tune/ comparison/0.9 comparison/0.1"
    assert by_kind == "comparison/0.9 comparison/0.1 run/0.5 tune/"  # stable: ties keep their order
    assert by_kind_desc == "tune/ run/0.5 comparison/0.9 comparison/0.1"
