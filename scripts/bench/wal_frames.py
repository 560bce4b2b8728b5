#!/usr/bin/env python3
"""Which b-trees a SQLite WAL's commits write: each frame header names its page, and `dbstat`
names the b-tree of each page. Only the frames of the WAL's current generation (by salt) count.

usage: wal_frames.py DB   (DB-wal beside it; both are copied first, so a running gateway's
                           database can be read: copy them mid-run for a busy WAL)
"""
import collections
import shutil
import sqlite3
import struct
import sys
import tempfile


def main(db):
    tmp = tempfile.mkdtemp()
    shutil.copy(db, tmp + "/x.db")
    shutil.copy(db + "-wal", tmp + "/x.db-wal")
    raw = open(tmp + "/x.db-wal", "rb").read()
    _magic, _version, page_size, _seq, salt1, salt2 = struct.unpack(">IIIIII", raw[:24])
    frames = []
    off = 32
    while off + 24 + page_size <= len(raw):
        page, db_size, s1, s2 = struct.unpack(">IIII", raw[off:off + 16])
        if (s1, s2) != (salt1, salt2):
            break
        frames.append((page, db_size))
        off += 24 + page_size
    con = sqlite3.connect(tmp + "/x.db")
    owner = dict((pageno, name) for name, pageno in con.execute("SELECT name, pageno FROM dbstat"))
    commits = max(1, sum(1 for _, size in frames if size))
    print(f"page size {page_size}, frames {len(frames)}, commits {commits}, "
          f"frames per commit {len(frames) / commits:.1f}")
    by_tree = collections.Counter(owner.get(page, "(free)") for page, _ in frames)
    for name, n in by_tree.most_common():
        print(f"  {name:40} {n:7} {n / commits:6.1f} per commit")
    shutil.rmtree(tmp)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
