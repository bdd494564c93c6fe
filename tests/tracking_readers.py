"""Read back what real trackers wrote: wandb's offline run files and an MLflow file store."""

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
    found: dict[str, Any] = {"config": {}, "history": [], "dir": runs[0].parent}
    for record in wandb_records(runs[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            found["project"], found["name"] = record.run.project, record.run.display_name
        elif kind == "config":
            found["config"].update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            found["history"].append({k: v for k, v in row.items() if k not in ("_runtime", "_timestamp")})
    found["config"].pop("_wandb", None)
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
