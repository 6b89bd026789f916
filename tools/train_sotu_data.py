"""The State of the Union corpus for the shipped default model: parsing and the fixed split.

Owns: reading ../shared/data/sotu/sotu.txt.xz (or an unpacked copy), cutting it into
addresses, and the one train / held-out split that the tokenizer trainer
(train_sotu_tokenizer.py), the model trainer (train_sotu_tiny.py) and the reference
outputs in tests/data/sotu-tiny/ all agree on.

File format (see the data's README): each address is three lines,
    "<|doc|> YEAR_NAME_PARTY\n"  header
    BODY "\n"                    the whole address on one line
    "\n"                         separator
The split: the LAST HELDOUT_DOCS addresses (2017_donald_j_trump_r .. 2021_joseph_r_biden_d)
are held out; every earlier address is training text. Headers are metadata and are
never tokenized; a document's text is its body line without the final newline.

Token streams: a split becomes one stream, for each address in file order
<|endoftext|> followed by the tokens of its body (the same shape in training and
evaluation).
"""

import hashlib
import lzma
import os

HELDOUT_DOCS = 5  # the last five addresses (2017-2021) are the held-out slice
DOC_MARK = b"<|doc|> "  # start of each address header line
EOT = "<|endoftext|>"  # document separator token (a Qwen2.5 special token)


class Doc:
    """One address: its header name and body, with byte offsets in the unpacked file."""

    def __init__(self, name, body, header_start, body_start, body_end):
        self.name = name  # e.g. "2017_donald_j_trump_r"
        self.body = body  # str, the address text (one line, no newline)
        self.header_start = header_start  # byte offset of "<|doc|>" in sotu.txt
        self.body_start = body_start  # byte offset of the body's first byte
        self.body_end = body_end  # byte offset one past the body's last byte


def default_data_path():
    """Where the corpus lives: $SOTU_DATA, else ../shared/data/sotu/sotu.txt.xz from the repo."""
    env = os.environ.get("SOTU_DATA")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.normpath(os.path.join(here, "..", "..", "shared", "data", "sotu", "sotu.txt.xz"))


def read_raw(path):
    """The unpacked corpus bytes (path ends in .xz: unpacked in memory)."""
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith(".xz"):
        data = lzma.decompress(data)
    return data


def parse_docs(raw):
    """Cut the unpacked corpus into Docs; raise ValueError on anything off-format."""
    docs = []
    pos = 0
    n = len(raw)
    while pos < n:
        if not raw.startswith(DOC_MARK, pos):
            raise ValueError(f"sotu: expected '<|doc|> ' at byte {pos}, found {raw[pos:pos + 20]!r}")
        header_end = raw.index(b"\n", pos)
        name = raw[pos + len(DOC_MARK):header_end].decode("ascii")
        body_start = header_end + 1
        body_end = raw.index(b"\n", body_start)
        body = raw[body_start:body_end].decode("utf-8")
        nxt = body_end + 1
        # one blank separator line, except possibly at the very end of the file
        if nxt < n and raw[nxt:nxt + 1] == b"\n":
            nxt += 1
        if nxt < n and not raw.startswith(DOC_MARK, nxt):
            raise ValueError(f"sotu: address {name} has more than one body line (byte {nxt})")
        docs.append(Doc(name, body, pos, body_start, body_end))
        pos = nxt
    return docs


def split_docs(docs):
    """(train, heldout): every address but the last HELDOUT_DOCS, and those last ones."""
    if len(docs) <= HELDOUT_DOCS:
        raise ValueError(f"sotu: only {len(docs)} addresses, need more than {HELDOUT_DOCS}")
    return docs[:-HELDOUT_DOCS], docs[-HELDOUT_DOCS:]


def stream_text(docs):
    """The text whose tokenization (special tokens recognized) is the split's token stream."""
    return "".join(EOT + d.body for d in docs)


def sha256_hex(data):
    """Hex SHA-256 of bytes or str (UTF-8)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    return hashlib.sha256(data).hexdigest()


def load_split(path=None):
    """(raw bytes, train docs, held-out docs) of the corpus at path (default: default_data_path())."""
    raw = read_raw(path or default_data_path())
    train, heldout = split_docs(parse_docs(raw))
    return raw, train, heldout


if __name__ == "__main__":
    raw, train, heldout = load_split()
    print(f"corpus: {len(raw)} bytes, sha256 {sha256_hex(raw)}")
    print(f"train: {len(train)} addresses {train[0].name} .. {train[-1].name}, "
          f"{sum(len(d.body.encode()) for d in train)} body bytes")
    print(f"held-out: {len(heldout)} addresses, bytes [{heldout[0].header_start}, {len(raw)})")
    for d in heldout:
        print(f"  {d.name}: body bytes [{d.body_start}, {d.body_end}) ({d.body_end - d.body_start} bytes)")
