#!/usr/bin/env python3
"""The training corpus: the reStructuredText sources of the Python 3.11 documentation as Debian 12's
python3.11-doc package ships them (/usr/share/doc/python3.11/html/_sources/**/*.rst.txt; PSF License
Agreement, code examples under the Zero-Clause BSD licence), lightly cleaned, split by document into a
training text and a held-out text.

  build_corpus.py --out DIR [--sources DIR | --deb FILE.deb]

Without --sources or --deb it reads the installed package, else runs `apt-get download
python3.11-doc` and unpacks it (dpkg-deb) in a temporary folder. Writes DIR/train.txt,
DIR/heldout.txt (documents separated by one blank line, UTF-8, NFC) and DIR/documents.json (each
document's source path, split and [start, end) character offsets in its text, so the trainer can
put <|endoftext|> between documents). Deterministic: the same package gives the same bytes.
"""
import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import unicodedata

SOURCES = "usr/share/doc/python3.11/html/_sources"
PACKAGE = "python3.11-doc"
HELDOUT_PERCENT = 3           # documents whose path hashes below this go to the held-out split
MIN_DOCUMENT_CHARS = 200      # tables of contents and stubs carry no text
# whatsnew/changelog is a list of issue numbers, not prose.
SKIPPED = {"whatsnew/changelog.rst.txt"}

ROLE = re.compile(r":(?:[a-z]+:)?([a-z-]+):`~?([^`]+)`")
INDEX_DIRECTIVE = re.compile(r"^\.\. (index|highlight|sectionauthor|moduleauthor|versionadded|testsetup)::")


def unpack_package(deb, tmp):
    if deb is None:
        subprocess.run(["apt-get", "download", PACKAGE], cwd=tmp, check=True,
                       stdout=subprocess.DEVNULL)
        debs = [f for f in os.listdir(tmp) if f.endswith(".deb")]
        if len(debs) != 1:
            sys.exit(f"build_corpus: apt-get download {PACKAGE} left {debs} in {tmp}")
        deb = os.path.join(tmp, debs[0])
    subprocess.run(["dpkg-deb", "-x", deb, os.path.join(tmp, "x")], check=True)
    return os.path.join(tmp, "x", SOURCES), os.path.basename(deb)


def role_text(m):
    """:func:`len` -> ``len``; :ref:`text <label>` and :term:`word` -> their English text."""
    role, body = m.group(1), m.group(2)
    label = re.match(r"(.*?)\s*<[^>]*>$", body)
    if label and label.group(1):
        body = label.group(1)
    return body if role in ("ref", "term", "doc", "pep", "rfc", "dfn", "title-reference") else f"``{body}``"


def clean(text):
    """Roles to their text; index/author/version-marker directives (and their indented bodies)
    dropped; trailing spaces and runs of blank lines trimmed."""
    out, skipping = [], False
    for line in text.splitlines():
        if skipping:
            if line.strip() == "" or line.startswith((" ", "\t")):
                continue
            skipping = False
        if INDEX_DIRECTIVE.match(line):
            skipping = True
            continue
        out.append(ROLE.sub(role_text, line).rstrip())
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text).strip("\n")
    return unicodedata.normalize("NFC", text)


def heldout(relpath):
    h = int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16)
    return h % 100 < HELDOUT_PERCENT


def read_documents(src):
    docs = []
    for root, _, files in os.walk(src):
        for name in files:
            if not name.endswith(".rst.txt"):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, src)
            if rel in SKIPPED:
                continue
            with open(path, encoding="utf-8") as f:
                text = clean(f.read())
            if len(text) >= MIN_DOCUMENT_CHARS:
                docs.append((rel, text))
    docs.sort()
    if not docs:
        sys.exit(f"build_corpus: no .rst.txt documents under {src}")
    return docs


def write_split(out, name, docs, index):
    parts, pos = [], 0
    for rel, text in docs:
        index.append({"path": rel, "split": name, "start": pos, "end": pos + len(text)})
        parts.append(text)
        pos += len(text) + 2
    with open(os.path.join(out, f"{name}.txt"), "w", encoding="utf-8", newline="\n") as f:
        f.write("\n\n".join(parts) + "\n")
    return pos


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--sources", help="an unpacked _sources folder")
    g.add_argument("--deb", help=f"a downloaded {PACKAGE} .deb")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src, origin = args.sources, "sources folder"
        if src is None and args.deb is None and os.path.isdir("/" + SOURCES):
            src, origin = "/" + SOURCES, f"installed {PACKAGE}"
        if src is None:
            src, origin = unpack_package(args.deb, tmp)
        docs = read_documents(src)
    train = [d for d in docs if not heldout(d[0])]
    held = [d for d in docs if heldout(d[0])]
    index = []
    n_train = write_split(args.out, "train", train, index)
    n_held = write_split(args.out, "heldout", held, index)
    meta = {"package": PACKAGE, "origin": origin, "licence": "PSF-2.0 (code examples 0BSD)",
            "documents": index, "train_chars": n_train, "heldout_chars": n_held}
    with open(os.path.join(args.out, "documents.json"), "w") as f:
        json.dump(meta, f, indent=0)
    print(f"build_corpus: {len(train)} training documents ({n_train:,} chars), {len(held)} held out "
          f"({n_held:,} chars) from {origin} -> {args.out}")


if __name__ == "__main__":
    main()
