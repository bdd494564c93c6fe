"""Read back what real trackers wrote: wandb's offline run files, an MLflow file store, Comet's offline archive, an Aim
repository, ClearML's offline session, DVCLive's files, SwanLab's record file and Trackio's SQLite database."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_WANDB_BLOCK = 32768  # wandb's transaction log is a LevelDB log: 32 KiB blocks of 7-byte-headed chunks
_WANDB_HEADER = 7  # b":W&B", a 2-byte key and a version byte


def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf ``Record`` messages of an offline run's ``run-<id>.wandb`` file."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    pos, chunks = _WANDB_HEADER, []
    while pos + 7 <= len(data):
        left = _WANDB_BLOCK - pos % _WANDB_BLOCK
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # block trailer / padding
            pos += left
            continue
        chunks.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk: a record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def wandb_offline_run(wandb_dir: Path) -> dict[str, Any]:
    """The project, name, config and history rows of the single offline run under ``<wandb_dir>/wandb``."""
    runs = sorted((wandb_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    found: dict[str, Any] = {"config": {}, "history": [], "dir": runs[0].parent, "kinds": []}
    for record in wandb_records(runs[0]):
        kind = record.WhichOneof("record_type")
        found["kinds"].append(kind)
        if kind == "run":
            found["project"], found["name"] = record.run.project, record.run.display_name
        elif kind == "config":
            found["config"].update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            found["history"].append({k: v for k, v in row.items() if k not in ("_runtime", "_timestamp")})
    found["config"].pop("_wandb", None)
    assert "project" in found, f"no run record in {runs[0]} ({runs[0].stat().st_size} bytes): {found['kinds']}"
    return found


def mlflow_runs(tracking_uri: str, experiment: str) -> list[dict[str, Any]]:
    """Name, params, tags and metric histories (``key -> [(step, value)]``) of each run of ``experiment``."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment!r} in {tracking_uri}"
    runs = []
    for run in client.search_runs([found.experiment_id]):
        history = {
            key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
            for key in run.data.metrics
        }
        runs.append(
            {
                "name": run.info.run_name,
                "params": run.data.params,
                "tags": run.data.tags,
                "metrics": history,
                "artifact_uri": run.info.artifact_uri,
                "status": run.info.status,
            }
        )
    return runs


def comet_offline_experiment(offline_dir: Path) -> dict[str, Any]:
    """Project, parameters, user metrics (``name -> [(step, value)]``) and "other" values of the single offline
    archive in ``offline_dir`` (Comet's own system metrics and markers left out)."""
    import zipfile

    (archive,) = offline_dir.glob("*.zip")
    with zipfile.ZipFile(archive) as zipped:
        experiment = json.loads(zipped.read("experiment.json"))
        messages = [json.loads(line) for line in zipped.read("messages.json").splitlines()]
    found: dict[str, Any] = {"project": experiment["project_name"], "params": {}, "metrics": {}, "other": {}}
    for message in messages:
        payload = message["payload"]
        if message["type"] == "parameter_msg" and payload["param"]["source"] == "manual":
            found["params"][payload["param"]["paramName"]] = payload["param"]["paramValue"]
        elif message["type"] == "metric_msg" and not payload["metric"]["metricName"].startswith("sys."):
            metric = payload["metric"]
            found["metrics"].setdefault(metric["metricName"], []).append((metric["step"], metric["metricValue"]))
        elif message["type"] == "log_other":
            found["other"][payload["key"]] = payload["value"]
    found["metrics"].pop("process duration", None)
    return found


def aim_run(repo_dir: Path, image_names: tuple[str, ...] = ()) -> dict[str, Any]:
    """Name, hparams, metric histories (``name -> [(step, value)]``, Aim's ``__system__`` ones left out) and the
    image sequences named (``name -> [(step, caption, size)]``) of the single run in the Aim repository at
    ``repo_dir``."""
    from aim import Repo
    from aim.sdk.index_manager import RepoIndexManager
    from aim.storage.context import Context

    (run_hash,) = Repo.from_path(str(repo_dir)).list_all_runs()
    # A closed run is read through the repository's index, which Aim's UI server would otherwise update.
    RepoIndexManager.get_index_manager(Repo.from_path(str(repo_dir))).index(run_hash)
    run = Repo.from_path(str(repo_dir)).get_run(run_hash)
    assert run is not None, f"run {run_hash} not found in {repo_dir}"
    metrics = {
        metric.name: list(zip(metric.data.indices_list(), metric.values.values_list(), strict=True))
        for metric in run.metrics()
        if not metric.name.startswith("__system__")
    }
    images: dict[str, list[tuple[int, str, tuple[int, int]]]] = {}
    for name in image_names:
        sequence = run.get_image_sequence(name, Context({}))
        assert sequence is not None, f"no image sequence {name!r}"
        steps, (values, *_) = sequence.data.items_list()
        pairs = zip(steps, values, strict=True)
        images[name] = [(step, image.caption, image.to_pil_image().size) for step, image in pairs]
    return {"name": run.name, "hparams": run["hparams"], "metrics": metrics, "images": images}


def clearml_offline_task(offline_dir: Path) -> dict[str, Any]:
    """Project, task name, configuration, scalars (``(title, series) -> [(iteration, value)]``), single values,
    tables (``title -> (header, columns)``) and debug images (``(title, series, iteration)``) of an offline session."""
    from clearml.utilities.config import text_to_config_dict

    task = json.loads((offline_dir / "task.json").read_text())
    events = [event for line in (offline_dir / "metrics.jsonl").read_text().splitlines() for event in json.loads(line)]
    found: dict[str, Any] = {
        "project": task["project_name"],
        "name": task["name"],
        "config": text_to_config_dict(task["configuration"]["General"]["value"]),
        "scalars": {},
        "single": {},
        "tables": {},
        "images": [],
    }
    for event in events:
        key = (event["metric"], event["variant"])
        if event["type"] == "training_stats_scalar" and event["metric"] == "Summary":
            found["single"][event["variant"]] = event["value"]
        elif event["type"] == "training_stats_scalar":
            found["scalars"].setdefault(key, []).append((event["iter"], event["value"]))
        elif event["type"] == "plot":
            (table,) = json.loads(event["plot_str"])["data"]
            found["tables"][key] = (event["iter"], table["header"]["values"], table["cells"]["values"])
        elif event["type"] == "training_debug_image":
            assert Path(event["url"]).is_file(), event
            found["images"].append((*key, event["iter"]))
    return found


def _number_or_text(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def dvclive_records(live_dir: Path) -> dict[str, Any]:
    """Params, the summary (``metrics.json``) and each metric's history (``name -> [(step, value)]``) DVCLive wrote."""
    import yaml

    history = {}
    for tsv in sorted((live_dir / "plots" / "metrics").glob("*.tsv")):
        _, *rows = (line.split("\t") for line in tsv.read_text().splitlines())
        history[tsv.stem] = [(int(step), _number_or_text(value)) for step, value in rows]
    return {
        "params": yaml.safe_load((live_dir / "params.yaml").read_text()),
        "summary": json.loads((live_dir / "metrics.json").read_text()),
        "history": history,
    }


def swanlab_offline_run(log_dir: Path) -> dict[str, Any]:
    """Project, name, config values, scalars (``key -> [(step, value)]``), media (``key -> [(step, count)]``) and
    final state of the single run under ``log_dir``, from its ``run-<id>.swanlab`` record file."""
    import yaml
    from google.protobuf.json_format import MessageToDict
    from swanlab.proto.swanlab.record.v1 import record_pb2
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    (record_file,) = log_dir.glob("run-*/run-*.swanlab")
    config = yaml.safe_load((record_file.parent / "files" / "config.yaml").read_text())
    found: dict[str, Any] = {
        "config": {key: entry["value"] for key, entry in config.items()},
        "scalars": {},
        "media": {},
    }
    reader = DataStoreReader()
    reader.open(record_file)
    for data in reader:
        record = record_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        body = MessageToDict(getattr(record, kind))
        if kind == "start":
            found["project"], found["name"] = body["project"], body["name"]
        elif kind == "scalar":
            found["scalars"].setdefault(body["key"], []).append((int(body["step"]), body["value"]["number"]))
        elif kind == "media":
            found["media"].setdefault(body["key"], []).append((int(body["step"]), len(body["value"]["items"])))
        elif kind == "finish":
            found["state"] = body["state"]
    reader.close()
    return found


def trackio_run(trackio_dir: Path, project: str, run: str) -> dict[str, Any]:
    """Config (Trackio's own ``_``-prefixed entries left out) and logged rows (``{"step": ..., **values}``) of one
    run, from the project's SQLite database."""
    import sqlite3

    with sqlite3.connect(trackio_dir / f"{project}.db") as db:
        rows = db.execute("SELECT step, metrics FROM metrics WHERE run_name = ? ORDER BY id", (run,)).fetchall()
        (config,) = db.execute("SELECT config FROM configs WHERE run_name = ?", (run,)).fetchone()
    db.close()
    return {
        "config": {key: value for key, value in json.loads(config).items() if not key.startswith("_")},
        "rows": [{"step": step, **json.loads(metrics)} for step, metrics in rows],
    }
