#!/bin/bash
# flatten.sh REF DEST: the package of git ref REF as an importable tree DEST/gdnkit (put DEST first on PYTHONPATH)
set -e
ref=$1; dest=$2
rm -rf "$dest"; mkdir -p "$dest/tmp"
git archive "$ref" gdnkit backends dispatch benchmarks | tar -x -C "$dest/tmp"
mv "$dest/tmp/gdnkit" "$dest/gdnkit"
for d in backends dispatch benchmarks; do mv "$dest/tmp/$d" "$dest/gdnkit/$d"; done
rm -rf "$dest/tmp" "$dest/gdnkit/benchmarks/results"
