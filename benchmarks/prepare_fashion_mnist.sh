#!/usr/bin/env bash
# Fashion-MNIST for benchmarks/gpu_science.py: the four idx files (31 MB) of Debian's
# dataset-fashion-mnist package, copied into OUT (default runs/fashion-mnist, which git ignores).
# Uses the installed package when there is one, else downloads the .deb with apt-get (no install).
set -euo pipefail
out=${1:-runs/fashion-mnist}
src=/usr/share/datasets/fashion-mnist
if [ ! -f "$src/train-images-idx3-ubyte.gz" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && apt-get download dataset-fashion-mnist >/dev/null)
  dpkg -x "$tmp"/dataset-fashion-mnist_*.deb "$tmp/root"
  src="$tmp/root/usr/share/datasets/fashion-mnist"
fi
mkdir -p "$out"
for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
  cp "$src/$f.gz" "$out/$f.gz"
done
du -sh "$out"
