"""Byte-level BPE as Qwen2/Qwen3's tokenizer.json describes it (NFC, the qwen2 split regex, GPT-2's
byte alphabet, merges by rank), so the training data is tokenized exactly as moraine and llama.cpp
tokenize it (tools/train/check_tokenizer.py compares the three). Needs the `regex` module (Debian:
python3-regex) for \\p{L} / \\p{N}."""
import json
import unicodedata

import regex

# The pre-tokenizer split of Qwen2/Qwen3 (tokenizer.json's Split pattern; moraine-convert names it "qwen2").
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def byte_alphabet():
    """GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the rest to U+0100 on."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


BYTE_TO_CHAR = byte_alphabet()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def split_merge(m):
    """A merges entry, "a b" or ["a", "b"], as a pair."""
    if isinstance(m, list):
        return m[0], m[1]
    a, b = m.split(" ", 1)
    return a, b


class ByteLevelBpe:
    """Encoder/decoder for one tokenizer.json (dict). Added tokens are not matched inside text: the
    corpus is checked to hold none of them (cut_tokenizer.py), so plain and special parsing agree."""

    def __init__(self, tok):
        model = tok["model"]
        if model.get("type") != "BPE":
            raise ValueError(f"tokenizer.json: model.type {model.get('type')!r} is not BPE")
        self.vocab = dict(model["vocab"])
        self.ranks = {split_merge(m): r for r, m in enumerate(model["merges"])}
        self.added = {a["content"]: a["id"] for a in tok.get("added_tokens", [])}
        self.id_to_token = {i: s for s, i in self.vocab.items()}
        self.id_to_token.update({i: s for s, i in self.added.items()})
        self.split = regex.compile(QWEN2_SPLIT)
        self.cache = {}

    @classmethod
    def from_file(cls, path):
        with open(path, encoding="utf-8") as f:
            return cls(json.load(f))

    def word_pieces(self, word):
        """BPE of one pre-token (already in the byte alphabet): the lowest-rank adjacent pair merges
        first, the leftmost among equal ranks (as HF tokenizers and llama.cpp do)."""
        hit = self.cache.get(word)
        if hit is not None:
            return hit
        parts = list(word)
        while len(parts) > 1:
            best, best_rank = -1, None
            for i in range(len(parts) - 1):
                r = self.ranks.get((parts[i], parts[i + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = i, r
            if best < 0:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        self.cache[word] = parts
        return parts

    def pre_tokens(self, text):
        for piece in self.split.findall(unicodedata.normalize("NFC", text)):
            yield "".join(BYTE_TO_CHAR[b] for b in piece.encode("utf-8"))

    def encode_pieces(self, text):
        out = []
        for word in self.pre_tokens(text):
            out.extend(self.word_pieces(word))
        return out

    def encode(self, text):
        ids = []
        for piece in self.encode_pieces(text):
            i = self.vocab.get(piece)
            if i is None:
                raise ValueError(f"BPE piece {piece!r} is not in the vocabulary (merges reach a token "
                                 "the vocabulary lacks)")
            ids.append(i)
        return ids

    def decode(self, ids):
        data = bytearray()
        for i in ids:
            s = self.id_to_token[i]
            if s in self.added:
                data.extend(s.encode("utf-8"))
            else:
                data.extend(CHAR_TO_BYTE[c] for c in s)
        return data.decode("utf-8", errors="replace")
