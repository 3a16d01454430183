"""ListOps as specified by the Long Range Arena.

Tay et al. 2020, "Long Range Arena: A Benchmark for Efficient Transformers", arXiv:2011.04006, Sec. 3.1:
prefix expressions over the digits 0-9 with the operators MAX, MIN, MED (median) and SM (sum modulo 10),
e.g. ``[MAX 4 3 [MIN 2 3 ] 1 0 [MED 1 5 8 9 2 ] ]`` whose value, the target (10 classes), is 5. The generator
is Nangia & Bowman 2018 (arXiv:1804.06028) with LRA's settings, ported from ``lra_benchmarks/data/listops.py``:

- ``generate_tree(depth)``: if ``depth < max_depth`` draw ``r ~ U[0, 1)``, else ``r = 1``. If
  ``r > VALUE_P = 0.25`` the node is a digit drawn uniformly from 0-9. Otherwise it is an operator node:
  draw ``n ~ U{2, ..., max_args}``, generate its ``n`` children at ``depth + 1`` in order, then draw the
  operator uniformly from (MIN, MAX, MED, SM). The root is generated at depth 1.
- Values: MIN/MAX of the arguments; SM = sum mod 10; MED = ``int(numpy.median(args))``, i.e. the
  middle element, or for an even count the floor of the mean of the two middle elements.
- Length is the number of symbols (an operator node counts its operator and its ``]``); a tree is kept when
  ``min_length < length < max_length`` (strict). LRA: depth 10, 10 arguments, lengths 500-2000, 96k/2k/2k
  train/val/test: the defaults. Splits (:func:`partition`): distinct trees, seeded shuffle, LRA's slices.
- Generation of a tree stops as soon as its length is certain to reach ``max_length`` (it would be rejected
  anyway): the random stream differs from LRA's script, the accepted trees have the same distribution.

With ``data_dir`` the splits are the LRA release's files instead (``lra_release/listops-1000/basic_train.tsv``,
``basic_val.tsv``, ``basic_test.tsv``; LRA's ``write_to_file``, a tab-separated ``csv.writer``): a header
``Source<TAB>Target``, then an expression and its value per line, every node wrapped in parentheses by LRA's
``to_string`` (``[MAX 2 9 ]`` is ``( ( ( [MAX 2 ) 9 ) ] )``).

Tokens are the symbols, parentheses dropped (they carry no information): vocabulary
``<pad> <cls> [MIN [MAX [MED [SM ] 0 ... 9`` (17 ids), the same for generated and read expressions. LRA's input
pipeline tokenised with ``tfds``' default tokenizer, which also drops ``]`` (making the expression ambiguous);
here ``]`` is kept. Label shares are uneven (0 and 9 the most common): compare accuracy with the majority class.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tasks.data.base import SPLITS, DataError, PackCollate, Sequences, Split, ZooDataModule, derive_seed, split_sizes
from tasks.data.tokenize import file_digest

VALUE_P = 0.25
OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
VOCAB = ("<pad>", "<cls>", *OPERATORS, "]", *(str(digit) for digit in range(10)))
PAD_ID, CLS_ID = 0, 1
OPERATOR_IDS = tuple(VOCAB.index(op) for op in OPERATORS)
END_ID = VOCAB.index("]")
DIGIT_IDS = tuple(VOCAB.index(str(digit)) for digit in range(10))
MAX_STALLED_DRAWS = 1_000_000  # draws in a row that add nothing before generation is declared impossible
#: the LRA release's file of each split in ``data_dir`` (its task name is "basic"), and its header
RELEASE_FILES: dict[Split, str] = {"train": "basic_train.tsv", "val": "basic_val.tsv", "test": "basic_test.tsv"}
RELEASE_HEADER = ("Source", "Target")
#: symbols an expression of a file may hold; LRA's parentheses are dropped
SYMBOL_IDS = {symbol: VOCAB.index(symbol) for symbol in (*OPERATORS, "]", *(str(digit) for digit in range(10)))}
PARENTHESES = frozenset(("(", ")"))
VALUE_TEXTS = frozenset(str(digit) for digit in range(10))
#: the generator's options with LRA's values (the defaults); with ``data_dir`` the files replace them
GENERATOR_SETTINGS = {
    "min_length": 500,
    "max_depth": 10,
    "max_args": 10,
    "train_size": 96_000,
    "val_size": 2_000,
    "test_size": 2_000,
}


class _TooLong(Exception):
    """Raised inside the recursion to abandon a tree that can no longer be shorter than ``max_length``."""


def _apply(op_id: int, args: list[int]) -> int:
    if op_id == OPERATOR_IDS[0]:
        return min(args)
    if op_id == OPERATOR_IDS[1]:
        return max(args)
    if op_id == OPERATOR_IDS[3]:
        return sum(args) % 10
    ordered = sorted(args)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) // 2


def _generate_tree(rng: random.Random, depth: int, max_depth: int, max_args: int, out: list[int], limit: int) -> int:
    """Append the tree's symbols to ``out`` and return its value; same random draws as LRA's
    ``generate_tree`` until the tree is abandoned for reaching ``limit`` symbols."""
    r = rng.random() if depth < max_depth else 1.0
    if r > VALUE_P:
        value = rng.choice(range(10))
        out.append(DIGIT_IDS[value])
        return value
    num_args = rng.randint(2, max_args)
    op_position = len(out)
    out.append(PAD_ID)  # the operator is drawn after the children, as in LRA
    args = []
    for _ in range(num_args):
        args.append(_generate_tree(rng, depth + 1, max_depth, max_args, out, limit))
        if len(out) + 1 >= limit:  # + this node's "]": the finished tree cannot be shorter than limit
            raise _TooLong
    op_id = rng.choice(OPERATOR_IDS)
    out[op_position] = op_id
    out.append(END_ID)
    return _apply(op_id, args)


def _max_tree_length(max_depth: int, max_args: int) -> int:
    length = 1  # a leaf at max_depth
    for _ in range(max_depth - 1):
        length = 2 + max_args * length
    return length


def generate_listops(
    num_examples: int, *, min_length: int, max_length: int, max_depth: int, max_args: int, seed: int
) -> tuple[list[list[int]], list[int]]:
    """``num_examples`` unique expressions (token ids) with ``min_length < len < max_length`` and their values."""
    rng = random.Random(seed)
    seen: set[bytes] = set()
    expressions, values = [], []
    stalled = 0
    while len(expressions) < num_examples:
        out: list[int] = []
        try:
            value = _generate_tree(rng, 1, max_depth, max_args, out, max_length)
        except _TooLong:
            value = None
        key = bytes(out)
        if value is None or not min_length < len(out) < max_length or key in seen:
            stalled += 1
            if stalled > MAX_STALLED_DRAWS:
                raise ValueError(
                    f"found only {len(expressions)} of {num_examples} unique expressions with "
                    f"{min_length} < length < {max_length} (max_depth={max_depth}, max_args={max_args}) in "
                    f"{MAX_STALLED_DRAWS} draws; widen the length range or ask for fewer examples"
                )
            continue
        stalled = 0
        seen.add(key)
        expressions.append(out)
        values.append(value)
    return expressions, values


def partition(num_examples: int, sizes: dict[Split, int], *, seed: int) -> dict[Split, list[int]]:
    """Indices ``0..num_examples-1`` shuffled by ``seed`` and cut into consecutive slices of ``sizes``
    (in the order train, val, test, as LRA slices its set of trees).

    LRA's ``main`` adds the kept trees to one Python ``set`` until it holds ``train + val + test`` distinct trees,
    lists the set in its iteration order and slices it, so the split a tree lands in follows its hash, not when
    it was drawn (with an unseeded ``random`` and per-process string hashing the script is not reproducible;
    the released TSVs are the data). The shuffle here plays the hash's part: at short lengths distinct trees
    are in effect drawn without replacement, frequent trees come early, and slicing in draw order would give
    train the common expressions and test the rare ones."""
    if sum(sizes.values()) != num_examples:
        raise ValueError(f"split sizes {sizes} do not add up to {num_examples} examples")
    order = list(range(num_examples))
    random.Random(seed).shuffle(order)
    parts, start = {}, 0
    for split in SPLITS:
        parts[split] = order[start : start + sizes[split]]
        start += sizes[split]
    return parts


def to_string(tokens: list[int] | torch.Tensor) -> str:
    """The expression as text, e.g. ``[MAX 4 [MIN 2 3 ] ]``; padding is dropped."""
    return " ".join(VOCAB[int(t)] for t in tokens if int(t) != PAD_ID)


def tokenize_expression(source: str) -> list[int]:
    """Token ids of an expression in LRA's text (parentheses dropped); ``ValueError`` naming the first symbol
    that is not a ListOps symbol."""
    ids = [SYMBOL_IDS.get(symbol, -1) for symbol in source.split() if symbol not in PARENTHESES]
    if -1 in ids:
        unknown = next(s for s in source.split() if s not in PARENTHESES and s not in SYMBOL_IDS)
        raise ValueError(f"unknown symbol {unknown!r}; a ListOps expression holds ( ) {' '.join(SYMBOL_IDS)}")
    return ids


def read_release_tsv(path: Path, max_length: int, prefix: list[int]) -> Sequences:
    """The expressions and values of one LRA release file (``Source<TAB>Target`` lines after that header), each
    expression ``prefix + tokens``; :class:`DataError` naming the file and line of a row that is not one."""
    lines = path.read_text(encoding="utf-8").splitlines()  # csv.writer ends lines with \r\n
    if not lines or tuple(lines[0].split("\t")) != RELEASE_HEADER:
        first = lines[0] if lines else ""
        raise DataError(f"{str(path)!r} line 1: expected the header 'Source<TAB>Target', got {first[:60]!r}")
    sequences, labels = [], []
    for number, line in enumerate(lines[1:], start=2):
        where = f"{str(path)!r} line {number}"
        fields = line.split("\t")
        if len(fields) != 2:
            raise DataError(f"{where}: {len(fields)} tab-separated fields, expected 2 (Source, Target)")
        source, target = fields
        try:
            ids = tokenize_expression(source)
        except ValueError as error:
            raise DataError(f"{where}: {error}") from None
        if not ids:
            raise DataError(f"{where}: the expression is empty")
        if len(ids) >= max_length:
            raise DataError(
                f"{where}: {len(ids)} symbols, not shorter than max_length={max_length}; raise max_length (LRA: 2000)"
            )
        if target.strip() not in VALUE_TEXTS:
            raise DataError(f"{where}: the value must be a digit 0-9, got {target!r}")
        sequences.append(torch.tensor(prefix + ids))
        labels.append(int(target))
    if not sequences:
        raise DataError(f"{str(path)!r} holds no expression after its header")
    return Sequences.from_tensors(sequences, torch.tensor(labels, dtype=torch.int64))


class ListOpsDataModule(ZooDataModule):
    """ListOps (Long Range Arena): classify the value 0-9 of a nested MAX/MIN/MED/SM expression.

    Generated deterministically from ``seed`` and cached: ``train + val + test`` distinct expressions from
    one stream, shuffled and sliced into the splits as LRA does, so no expression is in two splits. With
    ``data_dir``, read from the LRA release's files instead (whole, in their order; cached by the files' names,
    sizes and times); the generator's options then have no use, and a value other than LRA's is warned about.
    ``max_seq_len = max_length``: sequences are shorter than ``max_length`` (strict, as in LRA), so a
    prepended ``<cls>`` still fits.

    Args:
        data_dir: a folder holding the LRA release's ``basic_train.tsv``, ``basic_val.tsv`` and
            ``basic_test.tsv`` (``lra_release/listops-1000/`` of ``lra_release.gz``); None generates the data.
        min_length: sequences are longer than this many symbols (LRA: 500).
        max_length: sequences are shorter than this many symbols (LRA: 2000); also ``max_seq_len``.
        max_depth: maximum nesting depth, the root being depth 1 (LRA: 10).
        max_args: maximum arguments per operator, at least 2 (LRA: 10).
        train_size: training expressions (LRA: 96000).
        val_size: validation expressions (LRA: 2000).
        test_size: test expressions (LRA: 2000).
        prepend_cls: put ``<cls>`` (id 1) before each expression, for models that pool the first token.
        pack: pack each batch's examples into as few rows of ``max_seq_len`` tokens as they fit in (first-fit
            decreasing, :class:`tasks.data.base.PackCollate`), with their boundaries (``segments``), instead of one
            padded row each: the same examples and labels per step, less padding; the labels come in the rows'
            document order, the order the classifier pools them in. Attention stays inside each example.
        **loader: plus the loader options of :class:`tasks.data.base.ZooDataModule` (``seed``, ``shuffle_seed``,
            ``batch_size``, ``num_workers``, ``pad_to_max_len``, ``cache_dir``).
    """

    target = "sequence"
    cache_name = "listops"
    cache_fields = ("min_length", "max_length", "max_depth", "max_args", "sizes", "prepend_cls")

    def __init__(
        self,
        *,
        data_dir: str | None = None,
        min_length: int = 500,
        max_length: int = 2000,
        max_depth: int = 10,
        max_args: int = 10,
        train_size: int = 96_000,
        val_size: int = 2_000,
        test_size: int = 2_000,
        prepend_cls: bool = False,
        pack: bool = False,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        self.sizes = split_sizes(train_size, val_size, test_size)
        self.min_length, self.max_length = min_length, max_length
        self.max_depth, self.max_args = max_depth, max_args
        self.prepend_cls = prepend_cls
        self.pack = pack
        self.data_dir = Path(data_dir) if data_dir is not None else None
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2 (expressions are shorter than max_length), got {max_length}")
        if self.data_dir is None:
            self._check_generator()
        else:
            self._check_release()
        self.expose(vocab_size=len(VOCAB), max_seq_len=max_length, num_classes=10, pad_id=PAD_ID)
        self.cls_id = CLS_ID
        self._unclaimed: dict[Split, Sequences] = {}  # generated splits not yet handed to load_split

    def _check_generator(self) -> None:
        min_length, max_length, max_depth, max_args = self.min_length, self.max_length, self.max_depth, self.max_args
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        if max_args < 2:
            raise ValueError(f"max_args must be >= 2 (an operator takes 2 to max_args arguments), got {max_args}")
        if not 0 <= min_length < max_length - 1:
            raise ValueError(
                f"need 0 <= min_length < max_length - 1 so that some length n satisfies min_length < n < max_length; "
                f"got min_length={min_length}, max_length={max_length}"
            )
        longest = _max_tree_length(max_depth, max_args)
        if min_length + 1 > longest:
            raise ValueError(
                f"min_length={min_length} is unreachable: with max_depth={max_depth}, max_args={max_args} the "
                f"longest expression has {longest} symbols"
            )

    def _check_release(self) -> None:
        for name in RELEASE_FILES.values():
            if not (self.data_dir / name).is_file():
                raise FileNotFoundError(
                    f"ListOps data_dir {str(self.data_dir)!r} has no {name}: the LRA release lra_release.gz "
                    "(github.com/google-research/long-range-arena) has it in lra_release/listops-1000/; "
                    "or leave data_dir unset to generate the data"
                )
        options = {"min_length": self.min_length, "max_depth": self.max_depth, "max_args": self.max_args}
        options |= {f"{split}_size": size for split, size in self.sizes.items()}
        unused = [f"{name}={options[name]}" for name, lra in GENERATOR_SETTINGS.items() if options[name] != lra]
        if unused:
            warnings.warn(
                f"ListOps reads {str(self.data_dir)!r}: the generator's {', '.join(unused)} has no use with data_dir "
                "(the release's files are read whole)",
                stacklevel=3,
            )

    def cache_params(self) -> dict:
        if self.data_dir is None:
            return super().cache_params()
        files = [self.data_dir / name for name in RELEASE_FILES.values()]
        return {"release": file_digest(files, root=self.data_dir), "max_length": self.max_length} | {
            "prepend_cls": self.prepend_cls
        }

    def build_split(self, split: Split) -> Sequences:
        prefix = [CLS_ID] if self.prepend_cls else []
        if self.data_dir is not None:
            return read_release_tsv(self.data_dir / RELEASE_FILES[split], self.max_length, prefix)
        # every split comes from one pool of distinct trees: building any split builds all three, and the
        # others wait here until load_split asks for them (or finds them cached)
        if split not in self._unclaimed:
            total = sum(self.sizes.values())
            expressions, values = generate_listops(
                total,
                min_length=self.min_length,
                max_length=self.max_length,
                max_depth=self.max_depth,
                max_args=self.max_args,
                seed=derive_seed(self.seed, "listops"),
            )
            for name, indices in partition(total, self.sizes, seed=derive_seed(self.seed, "listops", "split")).items():
                sequences = [torch.tensor(prefix + expressions[i]) for i in indices]
                labels = torch.tensor([values[i] for i in indices], dtype=torch.int64)
                self._unclaimed[name] = Sequences.from_tensors(sequences, labels)
        return self._unclaimed.pop(split)

    def collate(self) -> Callable[[list], dict[str, Tensor]]:
        if self.pack:
            return PackCollate(self.pad_id, self.max_seq_len, pad_to=self.pad_to_max_len)
        return super().collate()
