"""Evaluation data: language-modelling texts and multiple-choice tasks.

Where data comes from, in order:

1. a data directory: the ``data_dir`` argument (CLI ``--data-dir``), else the
   ``CW_DATA_DIR`` environment variable, laid out as docs/method.md ("Evaluation data")
   describes (``gsm8k/test.jsonl``, ``fineweb_edu/*.jsonl``, ``mmlu/test/*_test.csv``,
   ``winogrande/dev.jsonl``, ``boolq/val.jsonl``; see :data:`LAYOUT`);
2. the Hugging Face hub through the ``datasets`` package, only when it is installed and
   the hub is not switched off (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``);
3. otherwise a :class:`DataError` that says where to put the files.

Plain files of the user's own texts are read by :func:`read_texts` (``.jsonl`` with a
text field, or ``.txt``: one text per blank-line-separated paragraph block, or the whole
file when it has no blank line), and the user's own task items by :func:`read_items`
(JSON lines with the fields of :data:`ITEM_FIELDS`).

Tasks are returned as :class:`ChoiceItem` (prompt, options, index of the right option),
scored by comparing the log-likelihood of each option after the prompt (method §4).
Order is deterministic: the first ``n`` items of the split (MMLU: subjects interleaved,
so a small ``n`` covers many subjects).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
#: a record and where it came from ("path:line", or the hub data set and row number)
Located = tuple[str, dict[str, Any]]

TEXT_DATASETS = ("gsm8k", "fineweb-edu")
TASKS = ("mmlu", "winogrande", "boolq")

#: file (glob) of each data set inside a data directory
LAYOUT: dict[str, str] = {
    "gsm8k": "gsm8k/test.jsonl",
    "fineweb-edu": "fineweb_edu/*.jsonl",
    "mmlu": "mmlu/test/*_test.csv",
    "winogrande": "winogrande/dev.jsonl",
    "boolq": "boolq/val.jsonl",
}

#: hub fallback: (path, config name, split, streaming)
HUB: dict[str, tuple[str, str | None, str, bool]] = {
    "gsm8k": ("openai/gsm8k", "main", "test", False),
    "fineweb-edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", True),
    "mmlu": ("cais/mmlu", "all", "test", False),
    "winogrande": ("allenai/winogrande", "winogrande_xl", "validation", False),
    "boolq": ("google/boolq", None, "validation", False),
}

MMLU_LETTERS = ("A", "B", "C", "D")


class DataError(FileNotFoundError):
    """Data could not be found or read; the message says where to put it."""


class MissingDataError(DataError):
    """A data set found neither in the data directory nor on the hub.

    The message names the API's ways out (``data_dir=``, ``CW_DATA_DIR``, the hub, a file
    of one's own); :meth:`for_command` words it for a command with its own options."""

    def __init__(self, name: str, where: Path, why: str) -> None:
        self.name, self.where, self.why = name, where, why
        own = (
            "read your own items with read_items(path, task)"
            if name in TASKS
            else "read your own texts with read_texts(path)"
        )
        super().__init__(
            self._message(
                "pass that folder as data_dir= (CLI: --data-dir DIR) or set CW_DATA_DIR=DIR",
                f"or {own}.",
            )
        )

    def __reduce__(self) -> tuple[Any, ...]:  # picklable despite the own __init__
        return (type(self), (self.name, self.where, self.why))

    def _message(self, folder: str, own: str) -> str:
        return (
            f"no {self.name} data found{self.why}. Put the files at {self.where} and "
            f"{folder}; or, online, `pip install datasets` to fetch {HUB[self.name][0]} "
            f"from the Hugging Face hub; {own}"
        )

    def for_command(self, command: str, own: str) -> DataError:
        """The same error worded for ``cw <command>``, whose options for the user's own
        data are ``own`` (e.g. ``"--texts FILE.jsonl or --file FILE.txt"``)."""
        return DataError(
            self._message(
                "pass that folder as --data-dir DIR (or set CW_DATA_DIR=DIR)",
                f"or give cw {command} your own file: {own}.",
            )
        )


@dataclass(frozen=True)
class ChoiceItem:
    """One multiple-choice item: the answer is ``options[answer]`` after ``prompt``."""

    prompt: str
    options: list[str]
    answer: int


# ---- locating ------------------------------------------------------------------------
def data_root(data_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The data directory to use: the argument, else ``$CW_DATA_DIR``, else None."""
    if data_dir is not None:
        path = Path(data_dir).expanduser()
        if not path.is_dir():
            raise DataError(f"data directory {path} does not exist; pass an existing --data-dir")
        return path
    env = os.environ.get("CW_DATA_DIR")
    return Path(env).expanduser() if env else None


def _local_files(name: str, data_dir: str | os.PathLike[str] | None) -> list[Path]:
    root = data_root(data_dir)
    if root is None or not root.is_dir():
        return []
    return sorted(root.glob(LAYOUT[name]))


def _hub_allowed() -> bool:
    offline = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    if any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in offline):
        return False
    import importlib.util

    return importlib.util.find_spec("datasets") is not None


def _missing(name: str, data_dir: str | os.PathLike[str] | None, why: str = "") -> MissingDataError:
    root = data_root(data_dir) if data_dir is not None else None
    where = root or os.environ.get("CW_DATA_DIR") or "<DIR>"
    return MissingDataError(name, Path(str(where)) / LAYOUT[name], why)


def _hub_rows(name: str, data_dir: str | os.PathLike[str] | None) -> Iterator[Located]:
    if not _hub_allowed():
        raise _missing(name, data_dir, " locally, and the hub is not available")
    import datasets

    path, config, split, streaming = HUB[name]
    try:
        ds = datasets.load_dataset(path, config, split=split, streaming=streaming)
    except Exception as err:  # network, auth, missing config: all mean "not available"
        raise _missing(name, data_dir, f" locally, and the hub failed ({err})") from err
    return ((f"{path} ({split}) row {k}", dict(row)) for k, row in enumerate(ds, 1))


def _jsonl(path: Path) -> Iterator[Located]:
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if line.strip():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}:{lineno} is not valid JSON ({err.msg})") from err
                if not isinstance(rec, dict):
                    raise DataError(f"{path}:{lineno} is not a JSON object (a record of fields)")
                yield f"{path}:{lineno}", rec


def _convert(fn: Callable[[dict[str, Any]], T], where: str, rec: dict[str, Any]) -> T:
    """``fn(rec)``; a missing field or a bad value becomes a DataError naming where."""
    try:
        return fn(rec)
    except KeyError as err:
        raise DataError(
            f"{where}: the record has no field {err.args[0]!r} (fields: {', '.join(rec)}); "
            "the file does not have the expected layout (see cw.data.LAYOUT; the formats "
            "are described in the project's docs/method.md, 'Evaluation data')"
        ) from None
    except (ValueError, TypeError) as err:
        raise DataError(f"{where}: bad value in the record ({err})") from err
    except DataError as err:
        raise DataError(f"{where}: {err}") from None


def _rows(name: str, data_dir: str | os.PathLike[str] | None) -> Iterator[Located]:
    files = _local_files(name, data_dir)
    if not files:
        return _hub_rows(name, data_dir)
    if name == "mmlu":
        return _mmlu_rows(files)
    return (row for f in files for row in _jsonl(f))


def _take(items: Iterable[Any], n: int | None) -> list[Any]:
    if n is not None and n < 1:
        raise ValueError(f"n must be a positive number of items, not {n}")
    return list(items if n is None else islice(items, n))


# ---- texts ---------------------------------------------------------------------------
def load_texts(
    dataset: str, n: int | None = None, data_dir: str | os.PathLike[str] | None = None
) -> list[str]:
    """The first ``n`` texts of ``"gsm8k"`` (question + "\\n" + answer) or ``"fineweb-edu"``."""
    key = dataset.lower().replace("_", "-")
    if key not in TEXT_DATASETS:
        raise ValueError(
            f"unknown text data set {dataset!r}; choose one of {', '.join(TEXT_DATASETS)}, "
            "or read your own file with read_texts(path)"
        )
    rows = _rows(key, data_dir)

    def text(r: dict[str, Any]) -> str:
        return f"{r['question']}\n{r['answer']}" if key == "gsm8k" else str(r["text"])

    texts = (_convert(text, where, r) for where, r in rows)
    return _take((t for t in texts if t.strip()), n)


def read_texts(path: str | os.PathLike[str], field: str = "text") -> list[str]:
    """Texts from a ``.jsonl`` file (``field`` of each record) or a ``.txt`` file.

    A ``.txt`` file holds one text per block separated by blank lines (the whole file is
    one text when it has no blank line).
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"text file {p} does not exist")
    if p.suffix == ".jsonl":
        texts = []
        for where, rec in _jsonl(p):
            if field not in rec:
                raise DataError(
                    f"{where}: the record has no field {field!r} (fields: {', '.join(rec)}); "
                    "pass the right field (CLI: --field)"
                )
            texts.append(str(rec[field]))
    elif p.suffix in (".txt", ".md", ""):
        raw = p.read_text(encoding="utf-8")
        blocks = [b.strip() for b in raw.replace("\r\n", "\n").split("\n\n")]
        texts = [b for b in blocks if b] if len(blocks) > 1 else [raw.strip()]
    else:
        raise DataError(f"{p}: unsupported file type {p.suffix!r}; use .jsonl or .txt")
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise DataError(f"{p} holds no non-empty text")
    return texts


# ---- tasks ---------------------------------------------------------------------------
def _mmlu_rows(files: list[Path]) -> Iterator[Located]:
    """Rows of every subject, interleaved (one from each subject in turn)."""
    readers = []
    for f in files:
        subject = f.name.removesuffix("_test.csv")
        fh = f.open(newline="", encoding="utf-8")
        readers.append((subject, csv.DictReader(fh), fh))
    try:
        while readers:
            alive = []
            for subject, reader, fh in readers:
                row = next(reader, None)
                if row is None:
                    fh.close()
                    continue
                alive.append((subject, reader, fh))
                where = f"{fh.name}:{reader.line_num}"
                yield where, _convert(_mmlu_record(subject), where, row)
            readers = alive
    finally:
        for _, _, fh in readers:
            fh.close()


def _mmlu_record(subject: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def record(row: dict[str, Any]) -> dict[str, Any]:
        return {
            "subject": subject,
            "question": row["question"],
            "choices": [row[f"choice{k}"] for k in range(4)],
            "answer": int(row["answer"]),
        }

    return record


def mmlu_item(row: dict[str, Any]) -> ChoiceItem:
    choices = row["choices"]
    if not isinstance(choices, (list, tuple)) or len(choices) != len(MMLU_LETTERS):
        raise DataError(f"an MMLU item needs a list of 4 choices, not {choices!r}")
    subject = str(row.get("subject", "")).replace("_", " ").strip()
    head = f"The following is a multiple choice question about {subject}.\n\n" if subject else ""
    lines = [head + str(row["question"]).strip()]
    lines += [f"{letter}. {c}" for letter, c in zip(MMLU_LETTERS, row["choices"], strict=True)]
    lines.append("Answer:")
    return ChoiceItem("\n".join(lines), [f" {x}" for x in MMLU_LETTERS], int(row["answer"]))


def winogrande_item(row: dict[str, Any]) -> ChoiceItem:
    """Prompt: the sentence up to the blank; options: each filler plus the rest."""
    sentence = str(row["sentence"])
    if sentence.count("_") != 1:
        raise DataError(f"WinoGrande sentence without exactly one blank: {sentence!r}")
    before, after = sentence.split("_")
    prompt = before.rstrip()
    sep = " " if before.endswith(" ") else ""
    options = [f"{sep}{row['option1']}{after}", f"{sep}{row['option2']}{after}"]
    return ChoiceItem(prompt, options, int(row["answer"]) - 1)


def boolq_item(row: dict[str, Any]) -> ChoiceItem:
    label = row.get("label", row.get("answer"))
    truth = label if isinstance(label, bool) else str(label).lower() == "true"
    question = str(row["question"]).strip().rstrip("?")
    question = question[:1].upper() + question[1:]
    prompt = f"{str(row['passage']).strip()}\nQuestion: {question}?\nAnswer:"
    return ChoiceItem(prompt, [" no", " yes"], int(truth))


def own_item(row: dict[str, Any]) -> ChoiceItem:
    """An item in the task-free format: ``prompt``, ``options`` (a list), ``answer`` (the
    0-based index of the right option)."""
    options = row["options"]
    if not isinstance(options, list) or len(options) < 2:
        raise DataError(f"'options' must be a list of at least 2 strings, not {options!r}")
    answer = row["answer"]
    if isinstance(answer, bool) or not isinstance(answer, int):
        raise DataError(f"'answer' must be the 0-based index of the right option, not {answer!r}")
    if not 0 <= answer < len(options):
        raise DataError(f"'answer' {answer} is not an index of the {len(options)} options")
    return ChoiceItem(str(row["prompt"]), [str(o) for o in options], answer)


_TASK_ITEM = {"mmlu": mmlu_item, "winogrande": winogrande_item, "boolq": boolq_item}

#: the fields of one item per task in a file of the user's own items (:func:`read_items`):
#: the records the task's loader reads (MMLU as JSON: ``choices`` a list of 4, ``answer``
#: 0-3, ``subject`` optional; BoolQ: ``label`` true/false, or ``answer``); any task also
#: takes an item in its own words, with the fields of :data:`OWN_ITEM_FIELDS`
ITEM_FIELDS: dict[str, tuple[str, ...]] = {
    "mmlu": ("question", "choices", "answer"),
    "winogrande": ("sentence", "option1", "option2", "answer"),
    "boolq": ("question", "passage", "label"),
}
#: an item in its own words: the prompt, the options that may follow it, the index of
#: the right one (0-based); scored like any task's item (method §4)
OWN_ITEM_FIELDS = ("prompt", "options", "answer")


def item_fields_help(task: str) -> str:
    """The fields of ``task``'s items in a JSONL file, for messages and help texts."""
    return (
        f"{', '.join(ITEM_FIELDS[task])} (or, for an item in its own words, "
        f"{', '.join(OWN_ITEM_FIELDS)})"
    )


def read_items(path: str | os.PathLike[str], task: str, n: int | None = None) -> list[ChoiceItem]:
    """The first ``n`` items of a JSON-lines file of the user's own items of ``task``.

    Each line is one JSON object, with the fields of ``task``'s data
    (:data:`ITEM_FIELDS`, as the loader reads the data directory) or, whatever the task,
    ``prompt``, ``options`` and ``answer`` (0-based). A missing field is reported with its
    name, the line and the fields expected.
    """
    key = task.lower()
    if key not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"items file {p} does not exist")
    needed = ITEM_FIELDS[key]

    def item(where: str, rec: dict[str, Any]) -> ChoiceItem:
        own = "prompt" in rec or "options" in rec
        fields = OWN_ITEM_FIELDS if own else needed
        absent = [f for f in fields if f not in rec and not (f == "label" and "answer" in rec)]
        if absent:
            raise DataError(
                f"{where}: the item has no field {absent[0]!r} (it has: "
                f"{', '.join(rec) or 'no fields'}); a {key} item needs the fields "
                f"{item_fields_help(key)}"
            )
        return _convert(own_item if own else _TASK_ITEM[key], where, rec)

    items = _take((item(where, rec) for where, rec in _jsonl(p)), n)
    if not items:
        raise DataError(f"{p} holds no items (one JSON object per line)")
    return items


def load_task(
    task: str, n: int | None = None, data_dir: str | os.PathLike[str] | None = None
) -> list[ChoiceItem]:
    """The first ``n`` items of ``"mmlu"`` (test), ``"winogrande"`` (dev) or ``"boolq"`` (val)."""
    key = task.lower()
    if key not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    rows = _rows(key, data_dir)
    if key == "mmlu" and not _local_files(key, data_dir):  # hub rows: adapt the fields
        rows = (
            (w, _convert(lambda r: {**r, "choices": list(r["choices"])}, w, r)) for w, r in rows
        )
    return _take((_convert(_TASK_ITEM[key], where, r) for where, r in rows), n)


__all__ = [
    "ITEM_FIELDS",
    "LAYOUT",
    "OWN_ITEM_FIELDS",
    "TASKS",
    "TEXT_DATASETS",
    "ChoiceItem",
    "DataError",
    "MissingDataError",
    "data_root",
    "load_task",
    "load_texts",
    "read_items",
    "read_texts",
]
