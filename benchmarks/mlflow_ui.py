"""What a person sees in the MLflow UI after two pretrain runs that differ in their learning rate.

Makes the two runs (40 steps each, each in its own directory, one store), serves the store with
`mlflow server` on 127.0.0.1 and takes headless Chromium screenshots of the runs table and of the
compare view, before and after "Show diff only", plus the text of those pages, into --out.

    python benchmarks/mlflow_ui.py --out /tmp/mlflow_ui

Needs Debian's chromium (apt-get install chromium) and, for the clicks, the npm package
playwright-core where node finds it (npm install playwright-core, in --node-modules' parent or on
$NODE_PATH). Not part of the test suite: two runs take a few minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from mlflow import MlflowClient

from uma_lightning.tools.mlflow_server import start_mlflow_server

REPO = Path(__file__).resolve().parents[1]
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
RUNS = {  # run directory -> command-line overrides of recipes/pretrain.yaml
    "lr_default": ["--trainer.max_steps", "40", "--trainer.val_check_interval", "20"],
    "lr_1e-3": ["--model.optimizer.lr", "1e-3", "--trainer.max_steps", "40", "--trainer.val_check_interval", "20"],
}

# Runs in node with playwright-core: the runs table, the compare view, then the compare view with
# "Show diff only" switched on; each page's visible text goes beside its screenshot.
SHOTS_JS = r"""
const { chromium } = require('playwright-core');
const [url, experiment, runs, out, flags] = process.argv.slice(2);
(async () => {
  const browser = await chromium.launch({ executablePath: '/usr/bin/chromium', args: JSON.parse(flags) });
  const page = await browser.newPage({ viewport: { width: 1700, height: 1000 } });
  const shot = async (name) => {
    await page.waitForTimeout(3000);
    await page.screenshot({ path: `${out}/${name}.png`, fullPage: true });
    require('fs').writeFileSync(`${out}/${name}.txt`, await page.innerText('body'));
  };
  await page.goto(`${url}/#/experiments/${experiment}/runs`);
  await page.getByText(' #', { exact: false }).first().waitFor({ timeout: 60000 });
  await shot('runs_table');
  await page.getByRole('button', { name: 'Columns' }).first().click();
  await shot('columns_menu');
  await page.keyboard.press('Escape');
  const ids = encodeURIComponent(JSON.stringify(JSON.parse(runs)));
  await page.goto(`${url}/#/compare-runs?runs=${ids}&experiments=${encodeURIComponent(JSON.stringify([experiment]))}`);
  await page.getByText('Show diff only').first().waitFor({ timeout: 60000 });
  await shot('compare');
  const toggles = page.getByRole('switch');
  for (let i = 0; i < await toggles.count(); i++) await toggles.nth(i).click();
  await shot('compare_diff_only');
  await browser.close();
})().catch((error) => { console.error(error); process.exit(1); });
"""


def train(out: Path, store: str) -> None:
    uma = shutil.which("uma", path=str(Path(sys.executable).parent))
    for run_dir, overrides in RUNS.items():
        (out / run_dir).mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        with open(out / run_dir / "uma.log", "w") as log:
            subprocess.run(
                [uma, "fit", "--config", str(REPO / "recipes/pretrain.yaml"), *overrides],
                cwd=out / run_dir,
                env={**os.environ, "MLFLOW_TRACKING_URI": store},
                stdout=log,
                stderr=subprocess.STDOUT,
                check=True,
            )
        print(f"{run_dir}: uma fit {' '.join(overrides)} ({time.monotonic() - start:.0f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the runs, the store and the screenshots")
    parser.add_argument("--node-modules", type=Path, help="node_modules folder that holds playwright-core")
    parser.add_argument("--reuse", action="store_true", help="take the screenshots of the runs already in --out")
    args = parser.parse_args()
    if not shutil.which("chromium"):
        raise SystemExit("needs Debian's chromium: apt-get install chromium")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    store = f"sqlite:///{out / 'mlflow.db'}"
    if not args.reuse:
        train(out, store)
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("pretrain").experiment_id
    runs = client.search_runs([experiment], order_by=["attributes.start_time DESC"], max_results=len(RUNS))
    for run in runs:
        datasets = ", ".join(f"{i.dataset.name} ({i.dataset.digest})" for i in run.inputs.dataset_inputs)
        finals = {k: round(v, 4) for k, v in run.data.metrics.items() if k.startswith("final/")}
        print(f"run {run.info.run_id}: name {run.info.run_name!r}, datasets {datasets}, {finals}")
    params = [run.data.params for run in runs]
    differing = sorted(key for key in set().union(*params) if len({p.get(key) for p in params}) > 1)
    print(f"params that differ ({len(differing)} of {len(params[0])}): {', '.join(differing)}")
    try:
        server, url = start_mlflow_server(store, out / "server.log")
    except RuntimeError as err:
        raise SystemExit(str(err)) from None
    try:
        script = out / "shots.js"
        script.write_text(SHOTS_JS)
        env = {**os.environ, **({"NODE_PATH": str(args.node_modules)} if args.node_modules else {})}
        ids = json.dumps([run.info.run_id for run in runs])
        subprocess.run(
            ["node", str(script), url, experiment, ids, str(out), json.dumps(CHROMIUM_FLAGS)],
            env=env,
            check=True,
            timeout=300,
        )
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"screenshots and page text: {out}/runs_table.png, compare.png, compare_diff_only.png (and .txt)")


if __name__ == "__main__":
    main()
