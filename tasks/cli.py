"""``zoo fit | validate | test``: LightningCLI over the tasks and data modules of ``tasks/``.

    zoo fit -c configs/listops.yaml                                   # full attention
    zoo fit -c configs/listops.yaml --model.attention nystrom         # swap the mechanism: one flag
    zoo fit -c configs/listops.yaml --model.attention linformer --model.attention_options.k 32
    zoo fit -c configs/listops.yaml --model.attention_options '{k: 32}'   # the same options as one YAML dict
    zoo fit -c configs/listops.yaml --ckpt_path last                  # resume the latest run of that mechanism
    zoo fit -c configs/listops.yaml --print_config                    # the resolved config

The sizes of :data:`LINKED` (``vocab_size``, ``max_seq_len``, ``num_classes``; for translation
``max_source_len``, ``max_target_len``) are set once, on the data module, and linked into the model, each
into a model whose ``__init__`` takes it (:func:`linked_sizes`). A wrong attention name or option stops
before training with the valid names or options. With the TensorBoard logger of the configs, a run logs to
``<save_dir>/<name>/<attention>/version_<n>/`` (events, ``config.yaml``, ``run.json``, ``checkpoints/``), so
``tensorboard --logdir <save_dir>/<name>`` overlays the mechanisms of one task; ``--ckpt_path last`` continues
the newest ``version_<n>`` of that mechanism.
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
``zoo validate`` / ``test`` read ``--ckpt_path last`` as the newest run's ``checkpoints/last.ckpt`` and log beside
that run, in its ``validate/`` or ``test/`` folder, as for a checkpoint file of a run; they refuse ``--ckpt_path
best`` and a ``last`` with no checkpoint (an untrained model) and name a vocabulary that differs from the
checkpoint's as the data's; ``--seed_everything`` must be in [0, 2**32 - 1]. A refusal raised inside the Trainer
(the data's ``prepare_data``, a task/data mismatch) removes
the run folder this command created. A size that ``--ckpt_path`` overrides (LightningCLI builds the model with
the checkpoint's hyperparameters) is named in one ``zoo <command>: warning:`` line.

A bad flag or config value is one line too (:func:`parser_error_line`: an unknown key with the nearest valid
ones, a value of the wrong type with the types allowed, a value outside a fixed set of choices with the choices)
instead of jsonargparse's usage and nested message;
a bare ``--verbose`` (``--verbose true|false`` stays Lightning's option of validate and test) or
``ZOO_VERBOSE=1`` prints that full message before the line.

A config is named by its path or, from any folder, by the name of a config installed with the package
(:func:`resolve_config_flags`): ``-c recall`` and ``-c configs/recall.yaml`` both read the packaged
``configs/recall.yaml`` where no such file exists in the working folder, and a file there always wins. Flags are
the config's keys (``--trainer.max_steps``); the dashed spelling (``--trainer.max-steps``) is read as the same key
(:func:`underscored_flags`).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import warnings
from argparse import ArgumentError
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero

from tasks import classification, data, retrieval, token_prediction, translation  # noqa: F401  (short names)
from tasks.base import ConfigError, ZooTask, read_checkpoint, state_dict_mismatches
from tasks.callbacks import SaveConfigToRun, zoo_progress_bar
from tasks.config_paths import ConfigNotFoundError, resolve_config
from tasks.data.base import DataError
from tasks.help_text import jsonargparse_formatter, plain

#: sizes set once on the data module and linked into the model, each into a task whose ``__init__`` takes it
#: (:func:`linked_sizes`): the encoder tasks take vocab_size, max_seq_len and num_classes, the translation task
#: vocab_size, max_source_len and max_target_len. A link whose attribute the data module lacks is skipped
#: (jsonargparse): a task paired with data that lacks one of its sizes gets None and says so (TranslationTask),
#: or fails its target check at setup.
LINKED = ("vocab_size", "max_seq_len", "num_classes", "max_source_len", "max_target_len")
#: ``--ckpt_path`` values that Lightning resolves itself (they name no file here)
SPECIAL_CKPT_PATHS = ("last", "best", "hpc")
#: the largest seed numpy (and so Lightning's seed_everything) accepts
MAX_SEED = 2**32 - 1
#: ``zoo fit | validate | test --verbose`` (bare; ``--verbose true|false`` is Lightning's own option of validate
#: and test) or ``ZOO_VERBOSE=1``: print the parser's full message before the one error line
VERBOSE_FLAG, VERBOSE_ENV = "--verbose", "ZOO_VERBOSE"
#: LightningCLI's config flags, whose value is a file or the name of a packaged config (:func:`resolve_config_flags`)
CONFIG_FLAGS = ("-c", "--config")
#: the subcommands that evaluate a checkpoint, each logged into the checkpoint's run (:func:`place_evaluation`)
EVALUATIONS = ("validate", "test")
#: Lightning's messages that say nothing about the run, silenced while a command runs: its advertisement, logged
#: by ``rank_zero_info`` at every Trainer (:func:`quiet_lightning`), and torch's deprecation of a class Lightning
#: itself still uses (``lightning/pytorch/utilities/_pytree.py``), warned at the first batch
LIGHTNING_TIP = "💡 Tip:"
LEAFSPEC_DEPRECATION = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
#: the help of ``zoo fit | validate | test``: what the command does, and examples (kept line for line)
SUBCOMMAND_HELP = {
    "fit": """zoo fit: train a task with one attention mechanism (LightningCLI over tasks/). -c names a config file, or
a packaged config by name from any folder (recall, listops, configs/recall.yaml); flags override its keys.

  zoo fit -c recall --model.attention nystrom
  zoo fit -c listops --model.attention linformer --model.attention_options.k 32 --trainer.max_steps 200
  zoo fit -c recall --ckpt_path last        # resume the newest run of that mechanism
  zoo fit -c recall --print_config          # the resolved config""",
    "validate": """zoo validate: evaluate a checkpoint on the validation split of its config's data. -c names a config
file, or a packaged config by name; the checkpoint's attention must be the model's (--model.attention).

  zoo validate -c recall --ckpt_path last
  zoo validate -c recall --model.attention nystrom --ckpt_path runs/recall/nystrom/version_0/checkpoints/last.ckpt""",
    "test": """zoo test: evaluate a checkpoint on the test split of its config's data. -c names a config file, or a
packaged config by name; the checkpoint's attention must be the model's (--model.attention).

  zoo test -c recall --ckpt_path last
  zoo test -c listops --model.attention local --ckpt_path runs/listops/local/version_0/checkpoints/last.ckpt""",
}
#: the titles of the model's and the data's options in that help (their classes' first docstring line is cut)
GROUP_TITLES = {
    "model": "The task and its model: --model.attention NAME, --model.attention_options.KEY VALUE, --model.dim, ...",
    "data": "The data: its module's options (--data.batch_size, --data.seq_len, ...; which ones: the config's data)",
}


class ZooCLI(LightningCLI):
    def __init__(self, args: list[str], *, run: bool = True, exit_on_error: bool = True) -> None:
        """``exit_on_error=False``: a bad argument raises jsonargparse's ``ArgumentError`` (``zoo fit`` turns it
        into one line) instead of printing the usage and the parser's message and exiting."""
        errors = {} if exit_on_error else {"exit_on_error": False}
        formatter = jsonargparse_formatter()
        # a subcommand's parser takes the main parser's formatter (jsonargparse)
        kwargs = errors | {"formatter_class": formatter}
        kwargs |= {name: {"description": plain(text)} | errors for name, text in SUBCOMMAND_HELP.items()}
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
            parser_kwargs=kwargs,
        )

    def setup_parser(self, *args: Any, **kwargs: Any) -> None:
        super().setup_parser(*args, **kwargs)
        for name, parser in getattr(self, "_subcommand_parsers", {}).items():
            parser.prog = f"zoo {name}"  # jsonargparse's would be "zoo [options] fit"

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # which task runs is known only after parsing, and parsing needs the links (a linked argument is not
        # required): every size is linked here, and before_instantiate_classes keeps the task's own
        for name in LINKED:
            parser.link_arguments(f"data.{name}", f"model.init_args.{name}", apply_on="instantiate")
        for group, title in GROUP_TITLES.items():
            if group in parser.groups:
                parser.groups[group].title = title

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
        config = self.config[subcommand] if subcommand is not None else self.config
        check_seed(config.get("seed_everything"))
        if subcommand is not None:
            saved = check_checkpoint(config.get("ckpt_path"), config.model.init_args)
            ignored = ignored_sizes(saved, config.model.init_args)
            if ignored:
                print(
                    f"zoo {subcommand}: warning: ignored {', '.join(ignored)}: the model is built with the sizes "
                    "saved in --ckpt_path",
                    file=sys.stderr,
                )

    def _run_subcommand(self, subcommand: str) -> None:
        # a refusal raised inside the Trainer (the data's prepare_data or setup, a task/data mismatch) comes after
        # the logger and the config callback have created the run folder: the folders this command created go
        created = [folder for folder in _log_dirs(self.trainer) if not folder.exists()]
        existing = {folder: _nearest_existing(folder) for folder in created}
        try:
            super()._run_subcommand(subcommand)
        except (ConfigError, DataError):
            for folder in created:
                remove_new_run(folder, existing[folder])
            raise

    def before_fit(self) -> None:
        check_resume(self.trainer, self.model, self.config.fit.get("ckpt_path"), "fit")

    def before_validate(self) -> None:
        keep_checkpoint_dirs(self.trainer, self.config.validate.get("ckpt_path"))
        check_resume(self.trainer, self.model, self.config.validate.get("ckpt_path"), "validate")

    def before_test(self) -> None:
        keep_checkpoint_dirs(self.trainer, self.config.test.get("ckpt_path"))
        check_resume(self.trainer, self.model, self.config.test.get("ckpt_path"), "test")

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        # the zoo's progress bar replaces Lightning's default one (a progress bar of the config's is kept)
        trainer = self._get(self.config_init, "trainer", default={})
        callbacks = [*(trainer.get("callbacks") or []), *kwargs.pop("callbacks", [])]
        if trainer.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(zoo_progress_bar())
        return super().instantiate_trainer(callbacks=callbacks, **kwargs)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        keep_size_links(self._parser(self.subcommand), linked_sizes(config.model.class_path))
        if self.subcommand == "fit":
            check_training_length(config.trainer)
        ckpt_path = config.get("ckpt_path")
        if self.subcommand in EVALUATIONS and ckpt_path == "last":
            # the newest run's last.ckpt, by name: then evaluated beside that run's files, as a file path would be
            newest = newest_last_checkpoint(config.trainer.logger, config.model.init_args.attention)
            if newest is not None:
                config.ckpt_path = ckpt_path = str(newest)
        if not (self.subcommand in EVALUATIONS and place_evaluation(config.trainer.logger, ckpt_path, self.subcommand)):
            place_run(config.trainer.logger, config.model.init_args.attention, resume=ckpt_path == "last")
        for logger in _listed(config.trainer.logger):
            init = getattr(logger, "init_args", None)
            if init is not None and init.get("save_dir") is not None:
                check_writable(Path(init.save_dir) / (init.get("name") or ""), init.save_dir)


def linked_sizes(task: str | type) -> tuple[str, ...]:
    """The sizes of :data:`LINKED` that ``task`` (a class or its import path) takes, as jsonargparse reads its
    ``__init__`` (following ``**kwargs`` into its bases)."""
    taken = set(init_options(task))
    return tuple(name for name in LINKED if name in taken)


def keep_size_links(parser: LightningArgumentParser, sizes: tuple[str, ...]) -> None:
    """Drop the links of :data:`LINKED` into the model other than ``sizes``. jsonargparse skips a link into an
    argument the model lacks but still counts it as applied, and LightningCLI saves every applied link as a
    hyperparameter: ``--ckpt_path FILE`` would then pass it back to an ``__init__`` that does not take it."""
    links = getattr(parser, "_links_group", None)  # jsonargparse has no public way to remove a link
    if links is None:
        return
    unused = {f"model.init_args.{name}" for name in LINKED if name not in sizes}
    links._group_actions[:] = [link for link in links._group_actions if link.target[0] not in unused]


def check_checkpoint(ckpt_path: str | None, model: Any) -> dict[str, Any] | None:
    """A ``--ckpt_path`` naming a file must be a readable checkpoint trained with the configured attention
    and options (from the config file or the flags). Lightning would otherwise take the checkpoint's,
    so ``--model.attention local`` with a ``full`` checkpoint would report full attention's numbers as
    local's. Testing another mechanism's checkpoint therefore needs its ``--model.attention`` (the error
    gives the flags). Returns the checkpoint's hyperparameters (None when ``ckpt_path`` names no file)."""
    if ckpt_path is None or not _names_a_file(str(ckpt_path)):
        return None
    saved = read_checkpoint(ckpt_path, "--ckpt_path").get("hyper_parameters", {})
    theirs, their_options = saved.get("attention"), saved.get("attention_options") or {}
    ours, our_options = model.attention, dict(model.get("attention_options") or {})
    if theirs is not None and (theirs, their_options) != (ours, our_options):
        flags = f"--model.attention {theirs} --model.attention_options '{json.dumps(their_options)}'"
        raise ConfigError(
            f"--ckpt_path {str(ckpt_path)!r} was trained with attention {theirs!r} options {their_options}, but the "
            f"model is configured with attention {ours!r} options {our_options}; to use this checkpoint, pass {flags}"
        )
    return saved


def ignored_sizes(saved: dict[str, Any] | None, model: Any) -> list[str]:
    """The model sizes configured (by a flag or the config) that a ``--ckpt_path`` file overrides: LightningCLI
    builds the model with the checkpoint's hyperparameters, so ``zoo test --ckpt_path run.ckpt --model.dim 32``
    tests the checkpoint's dim, silently. Sizes linked from the data (:data:`LINKED`) are not overridden (a
    mismatch there is refused by :func:`check_resume`)."""
    if not saved:
        return []
    return [
        f"--model.{name} {value} (checkpoint: {saved[name]})"
        for name, value in sorted(dict(model).items())
        if name not in LINKED and name in saved and _is_size(value) and _is_size(saved[name]) and value != saved[name]
    ]


def check_seed(seed: Any) -> None:
    """``--seed_everything``: true (a random seed), false / null (none) or an int in numpy's range [0, 2**32 - 1];
    Lightning would raise for any other int only once the run has started."""
    if _is_size(seed) and not 0 <= seed <= MAX_SEED:
        raise ConfigError(
            f"--seed_everything {seed}: a seed must be an int in [0, {MAX_SEED}] (or true for a random one)"
        )


def check_resume(trainer: Trainer, model: ZooTask, ckpt_path: str | None, stage: str = "fit") -> None:
    """The checkpoint a run starts from (``--ckpt_path last``: the run's newest ``last*.ckpt``, found as
    Lightning finds it) must fit the built model, checked before the Trainer writes anything: Lightning would
    first rewrite the run's config.yaml and TensorBoard files, then fail to load with a size-mismatch
    traceback. Refused in one line naming the sizes that differ (the integer hyperparameters that differ,
    e.g. ``dim``), or else weights whose shapes differ; ``last`` must also have the configured attention and
    options, as a named file must (:func:`check_checkpoint`). For ``validate`` and ``test`` the sizes that
    come from the data (:data:`LINKED`: a vocabulary of another size) are named as the data's."""
    if ckpt_path is None:
        return
    if str(ckpt_path) == "best" and stage != "fit":
        raise ConfigError(
            f"--ckpt_path best: zoo {stage} starts no training, so it has no best checkpoint; name a checkpoint "
            "file (e.g. <run>/checkpoints/last.ckpt) or use last"
        )
    if str(ckpt_path) == "last":
        found = {
            path
            for callback in trainer.checkpoint_callbacks
            if isinstance(callback, ModelCheckpoint)
            for path in callback._find_last_checkpoints(trainer)  # Lightning's own search for "last"
        }
        if not found and stage != "fit":
            where = str(Path(trainer.log_dir).parent) if trainer.log_dir else "the run folder"
            raise ConfigError(
                f"--ckpt_path last: no run under {where!r} has a last.ckpt: {stage} would run an untrained model; "
                "train one first (zoo fit), or name a checkpoint file"
            )
        if not found:
            return  # fit starts afresh (and Lightning says so)
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
    differing = [
        name
        for name in sorted(saved.keys() | ours.keys())
        if saved.get(name) != ours.get(name) and any(_is_size(v) for v in (saved.get(name), ours.get(name)))
    ]
    evaluating = stage != "fit"
    sizes = [
        f"{name} {ours.get(name)}{' from the data' if evaluating and name in LINKED else ''} "
        f"(checkpoint: {saved.get(name)})"
        for name in differing
    ]
    differ = f"sizes that differ: {', '.join(sizes)}" if sizes else f"e.g. {'; '.join(problems[:3])}"
    if evaluating and any(name in LINKED for name in differing):
        remedy = f"{stage} it on data of the checkpoint's vocabulary and sizes"
    elif evaluating:
        remedy = f"{stage} it with the run's own sizes"
    else:
        remedy = "resume with the run's own sizes, or start a new run without --ckpt_path"
    raise ConfigError(
        f"--ckpt_path {ckpt_path} ({path}) does not fit the configured model ({len(problems)} weights of other "
        f"shapes; {differ}); {remedy} (nothing was written)"
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


def _log_dirs(trainer: Trainer) -> list[Path]:
    """The run folders of the trainer's loggers (naming them creates nothing)."""
    folders = []
    for logger in trainer.loggers:
        log_dir = getattr(logger, "log_dir", None)
        if log_dir is not None:
            folders.append(Path(log_dir))
    return folders


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def remove_new_run(folder: Path, existing: Path) -> None:
    """Remove ``folder``, a run folder created by a command that was then refused, unless it holds a checkpoint,
    and the folders above it up to ``existing`` (which existed before) that are left empty."""
    if not folder.exists() or any(folder.rglob("*.ckpt")):
        return
    shutil.rmtree(folder, ignore_errors=True)
    parent = folder.parent
    while parent != existing and parent.is_dir() and not any(parent.iterdir()):
        parent.rmdir()
        parent = parent.parent


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
    if resume and (version := newest_version(Path(init.save_dir) / init.name)) is not None:
        init.version = version


def newest_last_checkpoint(logger: object, attention: str) -> Path | None:
    """``checkpoints/last.ckpt`` of the newest ``version_<n>`` that :func:`place_run` gives a TensorBoard logger
    without an explicit ``version`` for ``attention`` (what ``--ckpt_path last`` resumes); None if there is none."""
    if not getattr(logger, "class_path", "").endswith("TensorBoardLogger"):
        return None
    init = logger.init_args
    if init.get("version") is not None:
        return None
    root = Path(init.save_dir) / (f"{init.name}/{attention}" if init.get("name") else attention)
    version = newest_version(root)
    newest = None if version is None else root / f"version_{version}" / "checkpoints" / "last.ckpt"
    return newest if newest is not None and newest.is_file() else None


def newest_version(root: Path) -> int | None:
    """The largest n of the ``version_<n>`` folders in ``root``; None if there is none."""
    versions = [int(m[1]) for p in root.glob("version_*") if (m := re.fullmatch(r"version_(\d+)", p.name))]
    return max(versions) if versions else None


def place_evaluation(logger: object, ckpt_path: str | None, stage: str) -> bool:
    """Log ``zoo validate | test --ckpt_path <run>/checkpoints/FILE`` to ``<run>/<stage>/`` (``<run>/test/``): beside
    the fit's own files in the fit's folder, rather than in a new ``version_<n>`` as if it were another run, and
    without rewriting the fit's ``config.yaml``. Whether a TensorBoard logger was placed so (a checkpoint elsewhere
    is logged as before, by :func:`place_run`)."""
    if ckpt_path is None or not _names_a_file(str(ckpt_path)):
        return False
    checkpoints = Path(ckpt_path).parent
    placed = False
    for one in _listed(logger):
        if checkpoints.name == "checkpoints" and getattr(one, "class_path", "").endswith("TensorBoardLogger"):
            one.init_args.save_dir, one.init_args.name, one.init_args.version = str(checkpoints.parent), "", stage
            placed = True
    return placed


def keep_checkpoint_dirs(trainer: Trainer, ckpt_path: str | None) -> None:
    """Give each checkpoint callback of ``zoo validate | test`` the folder it had in the run that saved ``ckpt_path``
    (as that run recorded it), not one under this command's log folder: Lightning warns that "the dirpath has
    changed" when it restores the callback's state otherwise. Nothing is saved there (neither command trains)."""
    if ckpt_path is None or not _names_a_file(str(ckpt_path)):
        return
    saved = read_checkpoint(ckpt_path, "--ckpt_path").get("callbacks") or {}
    for callback in trainer.checkpoint_callbacks:
        state = saved.get(callback.state_key) if isinstance(callback, ModelCheckpoint) else None
        if state and state.get("dirpath") and callback.dirpath is None:
            callback.dirpath = state["dirpath"]


def build(argv: list[str], *, exit_on_error: bool = True) -> tuple[ZooTask, LightningDataModule]:
    """The task and data module that ``zoo fit <argv>`` would train, built without training, logging or
    writing anything (``zoo compare`` checks every mechanism this way before it starts). Raises
    :class:`ConfigError` (or jsonargparse's error: ``SystemExit``, or with ``exit_on_error=False`` an
    ``ArgumentError`` that :func:`parser_error_line` shortens) for a configuration ``zoo fit`` would refuse."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        cli = ZooCLI(
            [*resolve_config_flags(underscored_flags(argv)), "--trainer.logger=false"],
            run=False,
            exit_on_error=exit_on_error,
        )
    return cli.model, cli.datamodule


def run(subcommand: str, argv: list[str]) -> int:
    argv, verbose = take_verbose(argv)
    read = underscored_flags(argv)
    try:
        with warnings.catch_warnings():
            # argv always comes explicitly (from `zoo` or from tests); Lightning warns when sys.argv has args too
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
            warnings.filterwarnings("ignore", message=LEAFSPEC_DEPRECATION, category=FutureWarning)
            with quiet_lightning():
                ZooCLI([subcommand, *resolve_config_flags(read)], exit_on_error=False)
    except (ConfigError, DataError) as error:  # DataError: raised while the data is read, inside the Trainer
        print(f"zoo {subcommand}: error: {error}", file=sys.stderr)
        return 2
    except ArgumentError as error:  # jsonargparse: a bad flag or config value, before anything was built
        message = as_given(str(error), argv, read)
        if verbose:
            print(message, file=sys.stderr)
        more = "" if verbose else f" ({VERBOSE_FLAG} or {VERBOSE_ENV}=1: the parser's full message)"
        print(f"zoo {subcommand}: error: {parser_error_line(message)}{more}", file=sys.stderr)
        return 2
    finally:
        _close_process_group()
    return 0


class _DropTip(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(LIGHTNING_TIP)


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Drop Lightning's "💡 Tip" advertisement (:data:`LIGHTNING_TIP`) from its rank-zero log while the block runs;
    its other messages stay."""
    log, tip = logging.getLogger(rank_zero.__name__), _DropTip()
    log.addFilter(tip)
    try:
        yield
    finally:
        log.removeFilter(tip)


def _close_process_group() -> None:
    """Destroy the process group a distributed run made (Lightning leaves it open): left to the interpreter's exit,
    Gloo's threads can abort a finished run's process ("terminate called without an active exception", SIGABRT)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def resolve_config_flags(argv: list[str], flags: tuple[str, ...] = CONFIG_FLAGS) -> list[str]:
    """``argv`` with the value of every one of ``flags`` (default ``-c`` / ``--config``; ``--config=VALUE`` too)
    resolved by :func:`tasks.config_paths.resolve_config`: a file here as given, else the packaged config of that name.
    An inline config (``--config '{trainer: {max_steps: 5}}'``: YAML of a mapping, which LightningCLI also reads)
    passes as it is. A value that names no config raises :class:`ConfigError` (one line, the closest names)."""
    out = list(argv)
    for i, arg in enumerate(argv):
        flag, equals, value = arg.partition("=")
        if equals and flag in flags:
            out[i] = f"{flag}={_config_path(flag, value)}"
        elif arg in flags and i + 1 < len(argv):
            out[i + 1] = _config_path(arg, argv[i + 1])
    return out


def _config_path(flag: str, value: str) -> str:
    try:
        inline = isinstance(yaml.safe_load(value), dict)
    except yaml.YAMLError:
        inline = False
    if inline:
        return value
    try:
        return resolve_config(value)
    except ConfigNotFoundError as error:
        raise ConfigError(f"{flag} {value}: {error}") from None


def underscored_flags(argv: list[str]) -> list[str]:
    """``argv`` with the dashes of every ``--flag`` name (before any ``=``) read as underscores:
    ``--trainer.max-steps 5`` is ``--trainer.max_steps 5``. Every name LightningCLI reads is a Python name or a
    config key, so no flag has a dash of its own; values are left alone."""
    out = []
    for arg in argv:
        flag, equals, value = arg.partition("=")
        if arg.startswith("--") and len(flag) > 2 and "-" in flag[2:]:
            arg = "--" + flag[2:].replace("-", "_") + equals + value
        out.append(arg)
    return out


def as_given(message: str, given: list[str], read: list[str]) -> str:
    """A parser ``message`` with each flag named as the user spelled it in ``given`` (``--no-such-flag``), not as
    :func:`underscored_flags` made it for the parser (``read``)."""
    for ours, theirs in zip(read, given, strict=True):
        if ours != theirs:
            message = message.replace(ours.partition("=")[0], theirs.partition("=")[0])
    return message


def take_verbose(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` without a bare ``--verbose`` (one not followed by a value: ``--verbose false`` is Lightning's
    option of validate and test, and stays), and whether the parser's full messages were asked for."""
    kept, verbose = [], os.environ.get(VERBOSE_ENV, "") not in ("", "0")
    for i, arg in enumerate(argv):
        following = argv[i + 1] if i + 1 < len(argv) else None
        if arg == VERBOSE_FLAG and (following is None or following.startswith("-")):
            verbose = True
            continue
        kept.append(arg)
    return kept, verbose


def parser_error_line(message: str) -> str:
    """The one useful line of a jsonargparse error message, which nests the error under every type of a Union
    it tried (about 60 lines with the usage): an unknown option with the nearest valid ones, a value of the
    wrong type with the types allowed (a ``Literal``: its values), an unrecognized argument, or else the
    message's first line."""
    first = message.strip().splitlines()[0] if message.strip() else message
    top = re.match(r'Parser key "([^"]+)"', first)
    unknown = re.search(r"class_path '([\w.]+)':\s*\n\s*Option '([^']+)' is not accepted", message)
    if top and unknown:
        class_path, key = unknown.groups()
        flag = f"--{top[1]}.{key}"
        options = init_options(class_path)
        close = difflib.get_close_matches(key, options, n=3, cutoff=0.6)
        hint = (
            f"did you mean {' or '.join(f'--{top[1]}.{name}' for name in close)}?"
            if close
            else f"its options: {', '.join(options)}"
        )
        return f"{flag}: {class_path.rsplit('.', 1)[-1]} has no option {key!r}; {hint}"
    unrecognized = re.match(r"unrecognized arguments: (\S+)", first, flags=re.IGNORECASE)
    if unrecognized:
        flag = unrecognized[1].split("=", 1)[0]
        hint = ""
        if flag.startswith("--trainer."):
            close = difflib.get_close_matches(flag.removeprefix("--trainer."), init_options(Trainer), n=3)
            hint = f"; did you mean {' or '.join(f'--trainer.{name}' for name in close)}?" if close else ""
        return f"unrecognized argument {flag}{hint}"
    keys = [match for match in re.finditer(r'Parser key "([^"]+)"', message)]
    if keys:
        inner = message[keys[-1].end() :]
        given = re.search(r"(?:Given|Got) value: (.*)", inner)
        # the key's own type comes first; a later "Expected a <class 'NoneType'>" is the enclosing Union's
        types = re.search(r"Subtypes: \[(.*)\]", inner) or re.search(
            r"Expected a (<class '[^']+'>|typing\.Literal\[.*?\])\. Got value", inner
        )
        if given and types:
            name = ".".join(dict.fromkeys(k[1] for k in keys))
            return f"--{name} {given[1].strip()}: expected {_type_names(types[1])}"
    return first


def init_options(target: str | type) -> list[str]:
    """The parameters of a class's ``__init__`` (a class or its import path), and of its bases' while an
    ``__init__`` passes ``**kwargs`` on, as jsonargparse reads them; [] if they cannot be read."""
    options: dict[str, None] = {}
    try:
        if isinstance(target, str):
            module, _, name = target.rpartition(".")
            target = getattr(importlib.import_module(module), name)
        for cls in target.__mro__:
            if "__init__" not in vars(cls):
                continue
            parameters = inspect.signature(cls.__init__).parameters.values()
            options |= dict.fromkeys(
                p.name for p in parameters if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            )
            if not any(p.kind == p.VAR_KEYWORD for p in parameters):
                break
    except (ImportError, AttributeError, ValueError, TypeError):
        return []
    return list(options)


def _type_names(types: str) -> str:
    """``[dict[str, typing.Any], <class 'NoneType'>]`` -> ``dict[str, Any] or null``; ``typing.Literal['a', 'b']``
    -> ``one of 'a', 'b'``."""
    names = re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>", r"\1", types).replace("typing.", "").replace("NoneType", "null")
    parts = [part.strip() for part in re.split(r",\s*(?![^\[]*\])", names)]
    return " or ".join(re.sub(r"^Literal\[(.*)\]$", r"one of \1", part) for part in parts)


def run_fit(argv: list[str]) -> int:
    return run("fit", argv)


def run_validate(argv: list[str]) -> int:
    return run("validate", argv)


def run_test(argv: list[str]) -> int:
    return run("test", argv)
