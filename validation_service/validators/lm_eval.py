"""LMEvalValidator: EleutherAI's lm-evaluation-harness on a checkpoint, as a validate_fn.

The checkpoint is loaded as a Hugging Face causal LM (validators/hf.py: the Trainer's
and save_pretrained's folders, or a DCP folder with its config) and lm-eval's
``simple_evaluate`` runs its tasks on it, in the validation's Ray task. Extra
``ckval[lm-eval]``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from validation_service.errors import InvalidInput, PermanentValidationError
from validation_service.validation import check_resources

if TYPE_CHECKING:
    from ray.train import Checkpoint

__all__ = ["LMEvalValidator", "flat_metrics"]

# lm-eval's model_args that are the loading's, not HFLM's.
_LOAD_ARGS = ("config", "dtype")


@dataclasses.dataclass
class LMEvalValidator:
    """Runs lm-eval's ``tasks`` on the checkpoint; returns each task's metrics as flat
    names: ``"hellaswag/acc_norm"``, ``"hellaswag/acc_norm_stderr"`` (a filter other
    than lm-eval's "none" is added: ``"gsm8k/exact_match,strict-match"``).

    ``tasks``: lm-eval task or group names, task configs as dicts, or paths to task YAML
    files. A YAML file is read when the validator is made and travels with it; a
    ``data_files`` path in it is taken relative to the file's folder, and must be
    readable where the validation runs (a shared disk). ``include_path``: folders of
    task YAMLs on the validation's nodes, as lm-eval's ``--include_path``.

    ``num_fewshot``, ``limit`` and ``batch_size`` are lm-eval's. ``model_args``: HFLM's
    arguments (``tokenizer``: a path or name where the checkpoint has none, as a DCP
    folder; ``max_length``, ``add_bos_token``...), and for the loading ``config`` (a DCP
    folder's model config: a PretrainedConfig or its folder) and ``dtype``.
    ``validation_resources``: report's (e.g. ``{"num_gpus": 1}``); the model runs on a
    GPU when the task has one.
    """

    tasks: Sequence[str | dict[str, Any]]
    _: dataclasses.KW_ONLY
    num_fewshot: int | None = 0
    limit: int | float | None = None
    batch_size: int | str = 8
    model_args: dict[str, Any] | None = None
    validation_resources: dict[str, Any] | None = None
    include_path: str | Sequence[str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.tasks, (str, dict)):
            self.tasks = [self.tasks]
        if not isinstance(self.tasks, Sequence) or not self.tasks:
            raise InvalidInput(
                f"tasks must be a list of lm-eval task names, task configs (dicts) or task "
                f"YAML files, got {self.tasks!r}"
            )
        self.tasks = [_task_spec(task) for task in self.tasks]
        if self.num_fewshot is not None and not _count(self.num_fewshot):
            raise InvalidInput(f"num_fewshot must be an int >= 0, got {self.num_fewshot!r}")
        if self.limit is not None and not _is_limit(self.limit):
            raise InvalidInput(
                f"limit must be a number of documents (int >= 1) or a share (0 < float <= 1), "
                f"got {self.limit!r}"
            )
        if not (_count(self.batch_size) and self.batch_size > 0) and not (
            isinstance(self.batch_size, str) and self.batch_size.startswith("auto")
        ):
            raise InvalidInput(f"batch_size must be an int >= 1 or 'auto', got {self.batch_size!r}")
        if self.model_args is not None and not isinstance(self.model_args, dict):
            raise InvalidInput(f"model_args must be a dict, got {self.model_args!r}")
        if self.validation_resources is not None:
            self.validation_resources = check_resources(self.validation_resources)

    @property
    def recommended_resources(self) -> dict[str, Any]:
        """validation_resources for report(), watch() and revalidate()."""
        return dict(self.validation_resources or {"num_cpus": 1})

    def __call__(self, checkpoint: Checkpoint, config: dict[str, Any]) -> dict[str, Any]:
        with checkpoint.as_directory() as folder:
            results = self.evaluate(folder)
        return flat_metrics(results)

    def evaluate(self, folder: str) -> dict[str, Any]:
        """lm-eval's results of the checkpoint in ``folder`` (its ``"results"`` part)."""
        import lm_eval
        import torch
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager

        from validation_service.validators import hf

        args = dict(self.model_args or {})
        load = {name: args.pop(name) for name in _LOAD_ARGS if name in args}
        model = hf.load_model(folder, **load).eval()
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model.to(device)
        args.setdefault("tokenizer", _tokenizer(folder, args.get("tokenizer")))
        lm = HFLM(pretrained=model, batch_size=self.batch_size, device=device, **args)
        # lm-eval's own tasks are indexed only when one is asked for by name (seconds).
        configs_only = all(isinstance(task, dict) for task in self.tasks)
        manager = TaskManager(include_path=self.include_path, include_defaults=not configs_only)
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(self.tasks),
            num_fewshot=self.num_fewshot,
            limit=self.limit,
            task_manager=manager,
            log_samples=False,
            bootstrap_iters=0,
        )
        if not results or "results" not in results:
            raise PermanentValidationError(f"lm-eval returned no results for {self.tasks!r}")
        return results["results"]


def flat_metrics(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """lm-eval's ``{"task": {"acc,none": 0.5, "alias": ...}}`` as ``{"task/acc": 0.5}``:
    numbers only (an "N/A" standard error is left out)."""
    flat = {}
    for task, values in results.items():
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            metric, _, filter_name = key.partition(",")
            if not filter_name:
                continue  # sample counts and the like, not metrics
            name = metric if filter_name == "none" else f"{metric},{filter_name}"
            flat[f"{task}/{name}"] = float(value)
    return flat


def _tokenizer(folder: str, given: Any) -> Any:
    """The tokenizer: the one given, else the checkpoint's own files."""
    if given is not None:
        return given
    names = set(os.listdir(folder))
    if not names & {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"}:
        raise PermanentValidationError(
            f"the checkpoint {folder} has no tokenizer files (tokenizer.json...): pass "
            "model_args={'tokenizer': '<path or name>'}, or save the tokenizer with the "
            "model (Trainer(processing_class=tokenizer), tokenizer.save_pretrained)."
        )
    return folder


def _task_spec(task: Any) -> str | dict[str, Any]:
    """A task as lm-eval takes it; a YAML file read into its config now."""
    if isinstance(task, dict):
        if "task" not in task and "group" not in task:
            raise InvalidInput(f"a task config needs its 'task' name, got {task!r}")
        return dict(task)
    if isinstance(task, os.PathLike):
        task = os.fspath(task)
    if not isinstance(task, str) or not task:
        raise InvalidInput(f"a task is a name, a config dict or a YAML file, got {task!r}")
    if not task.endswith((".yaml", ".yml")):
        return task
    return _read_task_yaml(task)


def _read_task_yaml(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except FileNotFoundError:
        raise InvalidInput(f"no task YAML file at {path}") from None
    except yaml.YAMLError as exc:
        raise InvalidInput(
            f"the task YAML {path} cannot be read here ({exc}); a task with !function or "
            "include: lines is given by name, with its folder as include_path="
        ) from None
    if not isinstance(config, dict) or "task" not in config:
        raise InvalidInput(f"the task YAML {path} defines no 'task'")
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if files is not None:
        folder = os.path.dirname(os.path.abspath(path))
        config["dataset_kwargs"]["data_files"] = _relative_to(folder, files)
    return config


def _relative_to(folder: str, files: Any) -> Any:
    if isinstance(files, str):
        return files if "://" in files else os.path.join(folder, files)
    if isinstance(files, list):
        return [_relative_to(folder, f) for f in files]
    if isinstance(files, dict):
        return {split: _relative_to(folder, f) for split, f in files.items()}
    return files


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_limit(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return value >= 1 if isinstance(value, int) else 0 < value <= 1
