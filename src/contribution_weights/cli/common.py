"""Arguments shared by several sub-commands, and their conversion to API options."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from ..data import TEXT_DATASETS
from ..defaults import EMBEDDED_MODELS


def add_command(
    sub: argparse._SubParsersAction,
    name: str,
    run: Callable[[argparse.Namespace], int],
    about: str,
    description: str,
) -> argparse.ArgumentParser:
    """A sub-command's parser: ``cw NAME`` with ``about`` as its line in ``cw --help`` and
    ``description`` atop its own ``--help``, running ``run(args)``."""
    p: argparse.ArgumentParser = sub.add_parser(name, help=about, description=description)
    p.set_defaults(func=run)
    return p


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help=f"embedded ({', '.join(EMBEDDED_MODELS)}; default smollm2), a model folder, a .gguf "
        "file or a hub id",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="the model's weights and activations (default: as stored; float32 for the "
        "embedded GGUF models)",
    )
    p.add_argument("--device", default=None, help="e.g. cpu, cuda (default: cpu)")


def model_device(args: argparse.Namespace) -> str | None:
    """``--device``, or under a data-parallel launch on GPUs this process's own GPU."""
    if args.device is not None:
        return str(args.device)
    local = os.environ.get("LOCAL_RANK")
    if local is not None and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        import torch

        if torch.cuda.is_available():
            return f"cuda:{int(local)}"
    return None


def add_text_arguments(p: argparse.ArgumentParser, example: bool = True) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="the input text")
    src.add_argument("--file", type=Path, help="read the text from a file ('-' for stdin)")
    src.add_argument(  # any word is taken here, so that read_text can say what was meant
        "stdin",
        nargs="?",
        default=None,
        metavar="-",
        help="read the text from standard input (as --file -)",
    )
    if example:
        src.add_argument(
            "--example", action="store_true", help="use the example text shipped with the package"
        )
    add_newline_argument(p)


def add_trace_arguments(
    p: argparse.ArgumentParser, measures: str | None, measures_help: str, layers_help: str
) -> None:
    """What a trace covers: ``--measures`` (default ``measures``), ``--layers``, and
    ``--max-tokens`` with ``--truncate``."""
    p.add_argument("--measures", default=measures, help=measures_help)
    p.add_argument("--layers", type=parse_int_list, default=None, help=layers_help)
    p.add_argument("--max-tokens", type=int, default=None, help="longest text accepted")
    p.add_argument(
        "--truncate",
        action="store_true",
        help="keep the first --max-tokens tokens of a longer text",
    )


def add_newline_argument(p: argparse.ArgumentParser) -> None:
    """``--keep-trailing-newline``: a text read from a file or standard input loses one
    trailing newline by default (what an editor or ``echo`` adds), so that "the last
    token" is the text's own."""
    p.add_argument(
        "--keep-trailing-newline",
        action="store_true",
        help="keep the trailing newline of a --file or standard-input text (default: one "
        "trailing newline, which editors and echo add, is removed, so the last token is the "
        "text's own)",
    )


def read_text(args: argparse.Namespace) -> str:
    """The text a command was given: ``--example``, ``--text``, ``--file`` or standard
    input; from a file or standard input less one trailing newline unless
    ``--keep-trailing-newline``. A file that is not UTF-8 text is an InputError naming it."""
    if getattr(args, "example", False):
        from importlib.resources import files

        return files("contribution_weights").joinpath("examples/example.txt").read_text()
    if args.text is not None:
        return str(args.text)
    stdin = getattr(args, "stdin", None)
    if stdin is not None and stdin != "-":
        raise _input_error(
            f"unexpected argument {stdin!r}: pass a text file as --file {stdin}, a text as "
            "--text '...', or '-' to read standard input"
        )
    if stdin == "-" or str(args.file) == "-":
        try:
            text = sys.stdin.read()
        except UnicodeDecodeError as exc:
            raise _input_error(f"standard input is not UTF-8 text ({exc.reason} at byte "
                               f"{exc.start}); pass a text file") from None  # fmt: skip
        return text if getattr(args, "keep_trailing_newline", False) else _strip_newline(text)
    path = Path(args.file)
    if path.is_dir():
        raise _input_error(f"{path} is a folder, not a text file: pass a file to --file")
    if not path.is_file():
        raise FileNotFoundError(f"text file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise _input_error(
            f"{path} is not UTF-8 text (byte {exc.start} cannot be decoded: {exc.reason}); "
            "pass a text file, or convert it first (e.g. iconv -t UTF-8)"
        ) from None
    return text if getattr(args, "keep_trailing_newline", False) else _strip_newline(text)


def _strip_newline(text: str) -> str:
    """``text`` less one trailing newline (a line feed, or a carriage return and line feed)."""
    return text.removesuffix("\n").removesuffix("\r") if text.endswith("\n") else text


def add_corpus_arguments(p: argparse.ArgumentParser) -> None:
    """Where the texts of a corpus experiment come from: --dataset | --texts | --file,
    --field, --n and --data-dir (read them with :func:`load_corpus`)."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--dataset", choices=TEXT_DATASETS, help="evaluation data set")
    src.add_argument("--texts", type=Path, help="a .jsonl file of texts (field: --field)")
    src.add_argument("--file", type=Path, help="a .txt file (texts separated by blank lines)")
    p.add_argument("--field", default="text", help="JSONL field holding the text (default text)")
    p.add_argument("--n", type=positive_int, default=None, help="use the first N texts")
    p.add_argument("--data-dir", type=Path, default=None, help="data folder (else $CW_DATA_DIR)")
    p.add_argument(
        "--min-tokens",
        type=positive_int,
        default=None,
        help="skip texts of fewer tokens (with --join: join consecutive texts up to this "
        "length); --n then counts the texts kept",
    )
    p.add_argument(
        "--join",
        action="store_true",
        help="join consecutive texts, a blank line between, until each has --min-tokens tokens "
        "(for short items such as GSM8K's)",
    )


def load_corpus(args: argparse.Namespace) -> tuple[list[str], str]:
    """The texts named by :func:`add_corpus_arguments`, and their source (for titles).

    With ``--min-tokens`` every text is read and ``--n`` waits for :func:`fit_corpus`,
    which needs the model's tokenizer.
    """
    from .. import data

    if args.n is not None and args.n < 1:
        raise ValueError(f"--n must be at least 1, not {args.n}")
    if getattr(args, "join", False) and getattr(args, "min_tokens", None) is None:
        raise ValueError("--join needs --min-tokens N: the length each joined text must reach")
    n = None if getattr(args, "min_tokens", None) is not None else args.n
    if args.dataset:
        texts, source = data.load_texts(args.dataset, n, args.data_dir), str(args.dataset)
    else:
        path = args.texts or args.file
        texts, source = data.read_texts(path, field=args.field), str(path)
        texts = texts if n is None else texts[:n]
    if n is not None and len(texts) < n:
        notice(
            f"only {plural(len(texts), 'text')} in {source} (asked for --n {n}): running on those"
        )
    return texts, source


def fit_corpus(
    args: argparse.Namespace, model: object, texts: list[str], source: str
) -> tuple[list[str], str]:
    """``--min-tokens``/``--join`` applied to the texts of :func:`load_corpus` (then ``--n``),
    and the source named with what was done (it goes into the run's title and config)."""
    from ..inputs import texts_of_length

    min_tokens = getattr(args, "min_tokens", None)
    if min_tokens is None:
        return texts, source
    kept = texts_of_length(model, texts, min_tokens, join=args.join, n=args.n)  # type: ignore[arg-type]
    if not kept:
        raise ValueError(
            f"no text of {source} has {min_tokens} tokens; lower --min-tokens"
            + ("" if args.join else " or pass --join to join consecutive texts")
        )
    if args.n is not None and len(kept) < args.n:
        print(f"only {len(kept)} texts of {source} reach {min_tokens} tokens (asked for {args.n})")
    how = "consecutive texts joined to" if args.join else "texts of"
    return kept, f"{source} ({how} ≥{min_tokens} tokens)"


def parse_floats(value: str) -> list[float]:
    """An argparse type: ``"1,0.5,0"`` -> ``[1.0, 0.5, 0.0]`` (at least one number)."""
    try:
        out = [float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,0.5,0, not {value!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("give at least one number")
    return out


def positive_int(value: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, not {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def parse_int_list(value: str) -> list[int]:
    """``"0,5,-1"``, ranges ``"0-3"`` and negative ranges ``"-3--1"`` into ints."""
    out: list[int] = []
    for part in value.split(","):
        part = part.strip()
        if not part:
            continue
        match = _RANGE.fullmatch(part)
        if match is None:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not an index or a range; write e.g. 0,5,-1 or 0-3 or -3--1"
            )
        lo, hi = int(match[1]), int(match[2] if match[2] is not None else match[1])
        if hi < lo:
            raise argparse.ArgumentTypeError(
                f"range {part!r} is empty (its end is below its start)"
            )
        out.extend(range(lo, hi + 1))
    return out


def parse_bytes(value: str) -> int:
    """An argparse type: a size such as ``8G``, ``512M``, ``1.5GB`` or bytes."""
    from ..fields import as_bytes

    try:
        return as_bytes(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


_RANGE = re.compile(r"(-?\d+)(?:-(-?\d+))?")


# ---- checks made before any work (exit status 2 through InputError) ---------------------
def _input_error(message: str) -> Exception:
    """An :class:`~..inputs.InputError` (imported only for an error: it brings torch)."""
    from ..inputs import InputError

    return InputError(message)


def _probe_writable(folder: Path) -> str | None:
    """None when a file can be created in ``folder`` (tried, then removed), else why not."""
    import tempfile

    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".cw-write-check-")
    except OSError as err:
        return err.strerror or str(err)
    os.close(fd)
    os.unlink(name)
    return None


def _existing_ancestor(path: Path) -> Path:
    probe = path.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def _writable_base(
    path: Path, flag: str, folder: Path, verb: str, instead: str
) -> tuple[Path, str | None]:
    """The nearest existing folder at or above ``folder`` where ``path`` would be made, and
    None when a file can be created there, else why not; an existing file in the way is an
    InputError ("``flag path`` cannot be ``verb``: ...; give ``instead``")."""
    base = _existing_ancestor(folder)
    if not base.is_dir():
        raise _input_error(
            f"{flag} {path} cannot be {verb}: {base} is a file, not a folder; give {instead}"
        )
    return base, _probe_writable(base)


def check_out_dir(path: Path, flag: str = "--out") -> Path:
    """An output folder that exists and can be written, or that can be created."""
    if path.exists() and not path.is_dir():
        raise _input_error(
            f"{flag} {path} is an existing file, not a folder; give a new or existing folder"
        )
    base, why = _writable_base(path, flag, path, "created", "a folder elsewhere")
    if why is not None:
        what = "cannot be written" if base == path.absolute() else f"cannot be created in {base}"
        raise _input_error(f"{flag} {path} {what} ({why}); give a folder you can write to")
    return path


def check_run_folder(path: Path, resume: bool) -> None:
    """What can be said of an experiment's run folder before the model loads: a folder
    holding a run needs --resume (whether its options match is checked once the run's
    config is known), a folder holding other files but no run is refused (a run would
    mix its files with them), and --resume on an empty or missing folder starts a run,
    said so."""
    from ..runs import holds_run

    if holds_run(path, resume, flag="--resume"):
        return
    # the first process only: under accelerate launch the others may see its new files
    listed = _first_process() and path.is_dir()
    others = [p.name for p in path.iterdir() if not p.name.startswith(".")] if listed else []
    if others:
        shown = ", ".join(sorted(others)[:3]) + (", …" if len(others) > 3 else "")
        raise _input_error(
            f"--out {path} holds other files ({shown}) but no run (no config.json); "
            "choose a new or empty folder"
        )
    if resume:
        notice(f"no run in {path} yet: --resume starts a new one there")


def _first_process() -> bool:
    """Whether this is the first (or only) process: ``accelerate launch`` sets ``RANK``."""
    return os.environ.get("RANK", "0") == "0"


def notice(message: str) -> None:
    """A line for the user on standard error, said once: by the first process only when
    ``accelerate launch`` runs several (each sets ``RANK``)."""
    if _first_process():
        print(message, file=sys.stderr)


def plural(n: int, noun: str) -> str:
    """``n`` and the noun, plural unless ``n`` is 1: "1 layer", "30 layers"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def check_out_file(path: Path, flag: str = "--out") -> Path:
    """An output file name whose folder exists and can be written, or can be created."""

    if path.is_dir():
        raise _input_error(f"{flag} {path} is a folder; give a file name such as report.html")
    if path.exists() and not os.access(path, os.W_OK):
        raise _input_error(f"{flag} {path} exists and cannot be overwritten (no permission)")
    base, why = _writable_base(path, flag, path.parent, "written", "a path in a folder")
    if why is not None:
        raise _input_error(
            f"{flag} {path} cannot be created in {base} ({why}); give a path you can write to"
        )
    return path


def check_heads(
    heads: list[tuple[int, int]] | None,
    num_layers: int,
    num_heads: int,
    layers: list[int] | None,
) -> list[tuple[int, int]] | None:
    """``--heads`` pairs checked against the model's size and the traced layers; negative
    layers count from the end (returned as model layer indices)."""
    from ..inputs import resolve_layers

    if not heads:
        return heads
    traced = resolve_layers(layers, num_layers)
    out = []
    for layer, head in heads:
        idx = layer + num_layers if layer < 0 else layer
        if not 0 <= idx < num_layers:
            raise _input_error(
                f"--heads {layer}:{head}: layer {layer} does not exist; the model has "
                f"{num_layers} layers (0..{num_layers - 1}, or negative from the end)"
            )
        if not 0 <= head < num_heads:
            raise _input_error(
                f"--heads {layer}:{head}: head {head} does not exist; the model has "
                f"{num_heads} heads per layer (0..{num_heads - 1})"
            )
        if idx not in traced:
            raise _input_error(
                f"--heads {layer}:{head}: layer {idx} is not traced (--layers gives "
                f"{', '.join(map(str, traced))}); add it to --layers or pick a traced layer"
            )
        out.append((idx, head))
    return out


def print_written(folder: Path, files: Sequence[Path] | None = None) -> None:
    """The last line of a run: the ``files`` it wrote into ``folder`` (default: every file
    the run folder holds, read from the disk: a run folder holds its run only)."""
    names = (
        [Path(f).name for f in files]
        if files is not None
        else [p.name for p in Path(folder).iterdir() if p.is_file()]
    )
    print(f"wrote {folder}/{', '.join(sorted(names))}")
