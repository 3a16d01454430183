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
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from tasks import classification, data, token_prediction, translation  # noqa: F401  (short class names in configs)
from tasks.base import ConfigError, ZooTask
from tasks.callbacks import SaveConfigToRun

#: sizes set once on the data module and linked into the model: the encoder tasks take vocab_size,
#: max_seq_len and num_classes, the translation task vocab_size, max_source_len and max_target_len. A link
#: whose attribute the data module lacks is skipped (jsonargparse), and a task whose signature lacks the
#: target ignores it, so one list serves every pair of task and data module; a task paired with data that
#: lacks one of its sizes gets None and says so (TranslationTask), or fails its target check at setup.
LINKED = ("vocab_size", "max_seq_len", "num_classes", "max_source_len", "max_target_len")


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

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        place_run(config.trainer.logger, config.model.init_args.attention, resume=config.get("ckpt_path") == "last")


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
    except ConfigError as error:
        print(f"zoo {subcommand}: error: {error}", file=sys.stderr)
        return 2
    return 0


def run_fit(argv: list[str]) -> int:
    return run("fit", argv)


def run_validate(argv: list[str]) -> int:
    return run("validate", argv)


def run_test(argv: list[str]) -> int:
    return run("test", argv)
