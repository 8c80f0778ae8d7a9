"""One study run as a torchrun job (`train.nproc_per_node` > 1 in a study file).

The study worker writes the job to a file and launches `python -m studies.torchrun_job <file>` as N ranks; every
rank trains its share; rank 0 owns the MLflow run, reports validations to the Optuna trial through the shared
storage (which may prune it) and writes the result back. The worker keeps the trial's heartbeat meanwhile.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import optuna

from harness.config import RunConfig
from harness.distributed import exit_rank_after, joined, run_ranks
from harness.files import atomic_write, remove
from harness.run import Run
from harness.tracking import RunStatus
from harness.train import TrainResult, prepare_workspace, train
from studies.storage import make_storage, pruning_hook


@dataclass
class TrialLink:
    """Where rank 0 finds the Optuna trial a run reports to."""

    storage_url: str
    study_name: str
    trial_id: int
    pruner: str
    prunes: bool

    @classmethod
    def of(cls, trial: optuna.Trial, storage_url: str, pruner: str, prunes: bool) -> TrialLink:
        return cls(storage_url, trial.study.study_name, trial._trial_id, pruner, prunes)

    def hook(self):
        study = optuna.load_study(study_name=self.study_name, storage=make_storage(self.storage_url))
        return pruning_hook(optuna.trial.Trial(study, self.trial_id), self.pruner, self.prunes)


@dataclass
class RunJob:
    """Everything `train` needs, as plain data a file can carry to the ranks."""

    config: dict
    workdir: str
    device: str
    options: dict  # train()'s keyword arguments: run name, resume, tags, parent run, experiment, system metrics
    trial: TrialLink | None = None

    def launch(self, nproc_per_node: int) -> TrainResult:
        """Run the job as `nproc_per_node` ranks and return rank 0's result; a failed job raises."""
        handle, name = tempfile.mkstemp(prefix=".torchrun-job-", suffix=".json", dir=self.workdir)
        job_file = Path(name)
        with open(handle, "w") as out:
            json.dump(asdict(self), out)
        try:
            ended = run_ranks(nproc_per_node, "studies.torchrun_job", [str(job_file)], Path(self.workdir))
            if ended.lost is not None and ended.run_directory is not None:
                Run.at(ended.run_directory).record_ending(RunStatus.FAILED, ended.lost)  # rank 0 died before it could
            result = result_file(job_file)
            if ended.status != 0 or not result.exists():
                raise RuntimeError(
                    f"torchrun job of run {self.options['run_name']!r} exited with status {ended.status}"
                    f"{f' ({ended.lost})' if ended.lost else ''}; its MLflow run records the failing rank's reason"
                )
            values = json.loads(result.read_text())
        finally:
            remove(job_file)
            remove(result_file(job_file))
        return TrainResult(values["run_id"], Path(values["run_dir"]), values["validation"], [], None, values["stopped"])


def result_file(job_file: Path) -> Path:
    return job_file.with_suffix(".result.json")


def main(job_file: Path) -> int:
    """One rank of a job: train its share; rank 0 writes the result."""
    data = json.loads(job_file.read_text())
    link = TrialLink(**data["trial"]) if data["trial"] else None
    with joined(data["device"]) as (ranks, device):
        config = RunConfig.from_dict(data["config"])
        workspace = prepare_workspace(config, Path(data["workdir"]), device, ranks)
        hook = link.hook() if link is not None and ranks.is_main else None
        result = train(config, workspace, device=device, on_validation=hook, ranks=ranks, **data["options"])
    if ranks.is_main:
        values = {
            "run_id": result.run_id,
            "run_dir": str(result.run_dir),
            "validation": result.validation,
            "stopped": result.stopped_reason,
        }
        atomic_write(result_file(job_file), lambda tmp: tmp.write_text(json.dumps(values)))
    return 0


if __name__ == "__main__":
    exit_rank_after(lambda: main(Path(sys.argv[1])))
