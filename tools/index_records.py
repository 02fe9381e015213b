"""`python -m tools.index_records FILES`: write the index beside each TFRecord file that
reading by index needs (`app.data.indexed_records`), for files written elsewhere than
by `app.data.write_records` (which writes it).

    python -m tools.index_records data/train-*.tfrecord
    python -m tools.index_records --decompress data/train-00000.tfrecord.gz

The index (`<file>.index`) holds every record's byte offset, the file's size and
the CRCs of its first and last 64 KiB (`app.records`). A file already indexed is
checked against its index and left alone; a changed file is indexed again. A
compressed file cannot be read at an offset: `--decompress` rewrites it uncompressed
beside it (without its .gz, .gzip, .zz or .zlib suffix) and indexes that.

Exit codes: 0 every file indexed (or already), 2 a file that cannot be (the message
says why), each named on a line of its own.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.index_records",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="TFRecord files to index")
    p.add_argument("--decompress", action="store_true",
                   help="rewrite each compressed (GZIP or ZLIB) file uncompressed beside it, "
                        "and index that")
    p.add_argument("--force", action="store_true",
                   help="index a file again even when its index is current")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf  # starts here, after the arguments are checked

    from app import records

    failed = 0
    for path in args.files:
        start = time.perf_counter()
        try:
            if not tf.io.gfile.exists(path):
                raise records.RecordsError(f"{path}: no such file")
            if args.decompress:
                path = records.decompress(path)
            elif not args.force and _current(records, path):
                print(f"{path}: indexed already ({records.read_index(path).records} records)")
                continue
            else:
                records.index_file(path)
        except records.RecordsError as e:
            print(f"error: {e}", file=sys.stderr)
            failed += 1
            continue
        index = records.read_index(path)
        print(f"{path}: {index.records} records, {index.bytes} bytes, indexed in "
              f"{time.perf_counter() - start:.1f} s ({records.index_path(path)})")
    return 2 if failed else 0


def _current(records, path: str) -> bool:
    try:
        records.read_index(path)
    except records.RecordsError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
