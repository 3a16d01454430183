"""``zoo fit | validate | test``: LightningCLI over the tasks and data modules of ``tasks/``.

    zoo fit -c configs/listops.yaml                                   # full attention
    zoo fit -c configs/listops.yaml --model.attention nystrom         # swap the mechanism: one flag
    zoo fit -c configs/listops.yaml --model.attention linformer --model.attention_options.k 32
    zoo fit -c configs/listops.yaml --model.attention_options '{k: 32}'   # the same options as one YAML dict
    zoo fit -c configs/listops.yaml --ckpt_path last                  # resume the latest run of that mechanism
    zoo fit -c configs/listops.yaml --print_config                    # the resolved config

The sizes of :data:`LINKED` (``vocab_size``, ``max_seq_len``, ``num_classes``; for translation
``max_source_len``, ``max_target_len``) are set once, on the data module, and linked into the model. A
wrong attention name or option stops before training with the valid names or options. With the
TensorBoard logger of the configs, a run logs to ``<save_dir>/<name>/<attention>/version_<n>/`` (events,
``config.yaml``, ``run.json``, ``checkpoints/``), so ``tensorboard --logdir <save_dir>/<name>`` overlays
the mechanisms of one task; ``--ckpt_path last`` continues the newest ``version_<n>`` of that mechanism.
Setting ``--trainer.logger.init_args.version`` logs to ``<save_dir>/<name>/<version>/`` exactly.

Checked before anything is built or written (each failure is one ``zoo <command>: error:`` line, exit
code 2, and no run folder): a ``--ckpt_path`` file must be a readable Lightning checkpoint whose
attention and options are the model's (``zoo test --ckpt_path full.ckpt --model.attention local`` is
refused, not silently run with the checkpoint's weights under another mechanism); ``zoo fit`` refuses
``--trainer.max_steps 0`` and ``--trainer.max_epochs 0`` (a run that would stop before its first step);
every logger's ``save_dir`` must be a directory this process can write in (or creatable in one). Once the
model is built, and still before the Trainer writes anything: the checkpoint a run resumes from (``--ckpt_path
last``: the run's newest ``last.ckpt``) must have the configured attention and options and fit the model's
weights; otherwise one error line names the sizes that differ and the run's files stay as they were.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from tasks import classification, data, token_prediction, translation  # noqa: F401  (short class names in configs)
from tasks.base import ConfigError, ZooTask, read_checkpoint, state_dict_mismatches
from tasks.callbacks import SaveConfigToRun
from tasks.data.base import DataError

#: sizes set once on the data module and linked into the model: the encoder tasks take vocab_size,
#: max_seq_len and num_classes, the translation task vocab_size, max_source_len and max_target_len. A link
#: whose attribute the data module lacks is skipped (jsonargparse), and a task whose signature lacks the
#: target ignores it, so one list serves every pair of task and data module; a task paired with data that
#: lacks one of its sizes gets None and says so (TranslationTask), or fails its target check at setup.
LINKED = ("vocab_size", "max_seq_len", "num_classes", "max_source_len", "max_target_len")
#: ``--ckpt_path`` values that Lightning resolves itself (they name no file here)
SPECIAL_CKPT_PATHS = ("last", "best", "hpc")


class ZooCLI(LightningCLI):
    def __init__(self, args: list[str], *, run: bool = True) -> None:
        super().__init__(
            ZooTask,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_callback=SaveConfigToRun,
            save_config_kwargs={"overwrite": True},  # a resumed run rewrites its own config.yaml
            auto_configure_optimizers=False,  # each task owns its optimizer and schedule
            args=args,
            run=run,
        )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        for name in LINKED:
            parser.link_arguments(f"data.{name}", f"model.init_args.{name}", apply_on="instantiate")

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, FileNotFoundError) as error:
            # jsonargparse re-raises a constructor's error inside its own (it tries every type of a Union);
            # the constructor's message, at the root of the chain, is the one that says what is wrong
            root = error
            while root.__cause__ is not None:
                root = root.__cause__
            if isinstance(root, ConfigError):
                raise root from None
            if isinstance(root, (ValueError, FileNotFoundError)):
                raise ConfigError(str(root)) from error
            raise

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        # next, LightningCLI overwrites the model's settings with a --ckpt_path file's hyperparameters,
        # silently: the file and its attention are checked against the configured ones before that
        subcommand = self.config.get("subcommand")
        if subcommand is not None:
            check_checkpoint(self.config[subcommand].get("ckpt_path"), self.config[subcommand].model.init_args)

    def before_fit(self) -> None:
        check_resume(self.trainer, self.model, self.config.fit.get("ckpt_path"))

    def before_validate(self) -> None:
        check_resume(self.trainer, self.model, self.config.validate.get("ckpt_path"))

    def before_test(self) -> None:
        check_resume(self.trainer, self.model, self.config.test.get("ckpt_path"))

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if self.subcommand == "fit":
            check_training_length(config.trainer)
        place_run(config.trainer.logger, config.model.init_args.attention, resume=config.get("ckpt_path") == "last")
        for logger in _listed(config.trainer.logger):
            init = getattr(logger, "init_args", None)
            if init is not None and init.get("save_dir") is not None:
                check_writable(Path(init.save_dir) / (init.get("name") or ""), init.save_dir)


def check_checkpoint(ckpt_path: str | None, model: Any) -> None:
    """A ``--ckpt_path`` naming a file must be a readable checkpoint trained with the configured attention
    and options (from the config file or the flags). Lightning would otherwise take the checkpoint's,
    so ``--model.attention local`` with a ``full`` checkpoint would report full attention's numbers as
    local's. Testing another mechanism's checkpoint therefore needs its ``--model.attention`` (the error
    gives the flags)."""
    if ckpt_path is None or not _names_a_file(str(ckpt_path)):
        return
    saved = read_checkpoint(ckpt_path, "--ckpt_path").get("hyper_parameters", {})
    theirs, their_options = saved.get("attention"), saved.get("attention_options") or {}
    ours, our_options = model.attention, dict(model.get("attention_options") or {})
    if theirs is not None and (theirs, their_options) != (ours, our_options):
        flags = f"--model.attention {theirs} --model.attention_options '{json.dumps(their_options)}'"
        raise ConfigError(
            f"--ckpt_path {str(ckpt_path)!r} was trained with attention {theirs!r} options {their_options}, but the "
            f"model is configured with attention {ours!r} options {our_options}; to use this checkpoint, pass {flags}"
        )


def check_resume(trainer: Trainer, model: ZooTask, ckpt_path: str | None) -> None:
    """The checkpoint a run starts from (``--ckpt_path last``: the run's newest ``last*.ckpt``, found as
    Lightning finds it) must fit the built model, checked before the Trainer writes anything: Lightning would
    first rewrite the run's config.yaml and TensorBoard files, then fail to load with a size-mismatch
    traceback. Refused in one line naming the sizes that differ (the integer hyperparameters that differ,
    e.g. ``dim``), or else weights whose shapes differ; ``last`` must also have the configured attention and
    options, as a named file must (:func:`check_checkpoint`)."""
    if ckpt_path is None:
        return
    if str(ckpt_path) == "last":
        found = {
            path
            for callback in trainer.checkpoint_callbacks
            if isinstance(callback, ModelCheckpoint)
            for path in callback._find_last_checkpoints(trainer)  # Lightning's own search for "last"
        }
        if not found:
            return  # Lightning starts afresh (and says so)
        path = max(found, key=os.path.getmtime)
        check_checkpoint(path, model.hparams)
    elif _names_a_file(str(ckpt_path)):
        path = str(ckpt_path)
    else:
        return
    checkpoint = read_checkpoint(path, "--ckpt_path")
    problems = state_dict_mismatches(checkpoint["state_dict"], model.state_dict())
    if not problems:
        return
    saved, ours = checkpoint.get("hyper_parameters", {}), dict(model.hparams)
    sizes = [
        f"{name} {ours.get(name)} (checkpoint: {saved.get(name)})"
        for name in sorted(saved.keys() | ours.keys())
        if saved.get(name) != ours.get(name) and any(_is_size(v) for v in (saved.get(name), ours.get(name)))
    ]
    differ = f"sizes that differ: {', '.join(sizes)}" if sizes else f"e.g. {'; '.join(problems[:3])}"
    raise ConfigError(
        f"--ckpt_path {ckpt_path} ({path}) does not fit the configured model ({len(problems)} weights of other "
        f"shapes; {differ}); resume with the run's own sizes, or start a new run without --ckpt_path (nothing was "
        "written)"
    )


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _names_a_file(ckpt_path: str) -> bool:
    """Whether Lightning reads ``ckpt_path`` as a local file (not ``last``, ``best``, ``hpc``, a model
    registry name or a URL)."""
    return ckpt_path not in SPECIAL_CKPT_PATHS and not ckpt_path.startswith("registry") and "://" not in ckpt_path


def check_training_length(trainer: Any) -> None:
    """``max_steps`` / ``max_epochs`` of 0 (or below Lightning's -1 = unlimited) would "finish" at once,
    with exit code 0 and no checkpoint."""
    for name, value in (("max_steps", trainer.get("max_steps")), ("max_epochs", trainer.get("max_epochs"))):
        if value is not None and (value == 0 or value < -1):
            raise ConfigError(
                f"--trainer.{name} {value}: a run would stop before its first step and save nothing; "
                f"give {name} >= 1, or -1 for no limit"
            )


def check_writable(target: Path, save_dir: str) -> None:
    """Refuse a run directory ``target`` (under a logger's ``save_dir``) that cannot be created: its nearest
    existing ancestor must be a directory this process can create files in. Probed by creating (and at
    once deleting) a file there, since permission bits say nothing to root and nothing of read-only mounts."""
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    where = f"save_dir {save_dir!r}"
    if not existing.is_dir():
        raise ConfigError(f"{where}: cannot create {str(target)!r}: {str(existing)!r} is a file, not a directory")
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as error:
        raise ConfigError(f"{where}: cannot write in {str(existing)!r} ({error.strerror})") from None


def _listed(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def place_run(logger: object, attention: str, *, resume: bool) -> None:
    """Give a TensorBoard logger without an explicit ``version`` its per-mechanism directory,
    ``<save_dir>/<name>/<attention>/version_<n>``; on ``--ckpt_path last`` pick the newest existing
    ``version_<n>`` there, where Lightning then finds ``checkpoints/last.ckpt``. An explicit ``version``
    (``zoo compare`` sets one) means ``<save_dir>/<name>/<version>`` as given; other loggers are untouched."""
    if not getattr(logger, "class_path", "").endswith("TensorBoardLogger"):
        return
    init = logger.init_args
    if init.get("version") is not None:
        return
    init.name = f"{init.name}/{attention}" if init.get("name") else attention
    if resume:
        root = Path(init.save_dir) / init.name
        versions = [int(m[1]) for p in root.glob("version_*") if (m := re.fullmatch(r"version_(\d+)", p.name))]
        if versions:
            init.version = max(versions)


def build(argv: list[str]) -> tuple[ZooTask, LightningDataModule]:
    """The task and data module that ``zoo fit <argv>`` would train, built without training, logging or
    writing anything (``zoo compare`` checks every mechanism this way before it starts). Raises
    :class:`ConfigError` (or jsonargparse's error) for a configuration ``zoo fit`` would refuse."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        cli = ZooCLI([*argv, "--trainer.logger=false"], run=False)
    return cli.model, cli.datamodule


def run(subcommand: str, argv: list[str]) -> int:
    try:
        with warnings.catch_warnings():
            # argv always comes explicitly (from `zoo` or from tests); Lightning warns when sys.argv has args too
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
            ZooCLI([subcommand, *argv])
    except (ConfigError, DataError) as error:  # DataError: raised while the data is read, inside the Trainer
        print(f"zoo {subcommand}: error: {error}", file=sys.stderr)
        return 2
    return 0


def run_fit(argv: list[str]) -> int:
    return run("fit", argv)


def run_validate(argv: list[str]) -> int:
    return run("validate", argv)


def run_test(argv: list[str]) -> int:
    return run("test", argv)
