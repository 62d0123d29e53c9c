#!/usr/bin/env bash
# Prepares the five real data sets of the LR benchmarks under benchmarks/data/ (git-ignored):
#
#   digits          the demo set, made by the workflow (scikit-learn's digits, no download)
#   fashion-mnist   benchmarks/fashion_mnist.py  6,000 train / 1,000 val, 28x28 grayscale
#   cifar-10        benchmarks/cifar10.py        the first whole images of each batch, 32x32
#   tiny-imagenet   benchmarks/tiny_imagenet.py  20 classes, 5,000 / 1,000, 64x64 colour
#   flowers-17      benchmarks/flowers17.py      17 classes, 1,020 / 340, 64x64 colour
#
# The raw files are read out of git copies of public GitHub repositories, at pinned commits:
#
#   github:Dzox13524/kuis2_JST          917b61ba16ba4c16ea0e50f0a8dac7b20b5f5223
#       data/FashionMNIST/raw/train-images-idx3-ubyte.gz (a byte prefix of the published file)
#   github:zalandoresearch/fashion-mnist b2617bb6d3ffa2e429640350f613e3291e10b141
#       data/fashion/train-labels-idx1-ubyte.gz
#   github:zhi-fangZhang/idpl_gen       0626f9d08138278bbe0b970a3055d714150ab4a0
#       data/cifar-10-batches-py/ (byte prefixes of the published batches)
#   github:Sachitbansal/DLA             44579204a3d8506f5aa76fb6695aa3b81eefe66a
#       tiny-imagenet-200/ (words.txt, val/, train/<wnid>/ of the 20 classes)
#   github:yangxue0827/RCNN             4530523c6ae1108db622bd4f9ea76e0ae10fd6a5
#       17flowers/jpg/ (the 1,360 photographs, sorted into one folder per label)
#
# Each is looked for at $MIRRORS/<owner>+<name>/repo, a bare git directory or a clone with its
# .git inside (MIRRORS defaults to /work/.mirror). Without that layout at hand:
#
#   git clone --bare https://github.com/Sachitbansal/DLA "$MIRRORS/Sachitbansal+DLA/repo"
#
# and likewise for the others. Nothing is downloaded here; the script only reads the mirrors and
# writes benchmarks/data/. Run from anywhere; about 2 minutes on 2 cores.
#
#   MIRRORS=/path/to/mirrors nice -n 10 bash benchmarks/prepare_data.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MIRRORS=${MIRRORS:-/work/.mirror}
PY=${PYTHON:-.venv/bin/python}
DATA=benchmarks/data
mkdir -p "$DATA"

# The git directory of owner/name's mirror; refuses (one sentence) when it or the commit is absent.
git_dir() {
  local repo=$1 commit=$2 dir="$MIRRORS/${1/\//+}/repo"
  [[ -d $dir/.git ]] && dir=$dir/.git
  if ! git --git-dir="$dir" cat-file -e "$commit^{commit}" 2>/dev/null; then
    echo "No git copy of github:$repo with commit $commit at $dir: clone github:$repo there (see this script's header) or set MIRRORS." >&2
    exit 1
  fi
  echo "$dir"
}

FASHION_IMAGES=$(git_dir Dzox13524/kuis2_JST 917b61ba16ba4c16ea0e50f0a8dac7b20b5f5223)
FASHION_LABELS=$(git_dir zalandoresearch/fashion-mnist b2617bb6d3ffa2e429640350f613e3291e10b141)
CIFAR=$(git_dir zhi-fangZhang/idpl_gen 0626f9d08138278bbe0b970a3055d714150ab4a0)
TINY=$(git_dir Sachitbansal/DLA 44579204a3d8506f5aa76fb6695aa3b81eefe66a)
FLOWERS=$(git_dir yangxue0827/RCNN 4530523c6ae1108db622bd4f9ea76e0ae10fd6a5)

# A fresh, empty raw folder for one data set.
fresh() { rm -rf "${DATA:?}/$1" && mkdir -p "$DATA/$1"; }

echo "== digits (the workflow's demo set)"
.venv/bin/snakemake --cores 2 results/demo/digits
rm -rf "$DATA/digits" && cp -r results/demo/digits "$DATA/digits"

echo "== fashion-mnist"
fresh fashion-mnist-raw
git --git-dir="$FASHION_IMAGES" show 917b61ba16ba4c16ea0e50f0a8dac7b20b5f5223:data/FashionMNIST/raw/train-images-idx3-ubyte.gz \
  > "$DATA/fashion-mnist-raw/train-images-idx3-ubyte.gz"
git --git-dir="$FASHION_LABELS" show b2617bb6d3ffa2e429640350f613e3291e10b141:data/fashion/train-labels-idx1-ubyte.gz \
  > "$DATA/fashion-mnist-raw/train-labels-idx1-ubyte.gz"
"$PY" benchmarks/fashion_mnist.py

echo "== cifar-10"
fresh cifar-10-raw
git --git-dir="$CIFAR" archive 0626f9d08138278bbe0b970a3055d714150ab4a0 data/cifar-10-batches-py \
  | tar -x --strip-components=2 -C "$DATA/cifar-10-raw"
"$PY" benchmarks/cifar10.py

echo "== tiny-imagenet"
fresh tiny-imagenet-raw
read -r -a WNIDS <<< "$("$PY" -c 'import sys; sys.path.insert(0, "benchmarks"); import tiny_imagenet; print(*tiny_imagenet.WNIDS)')"
# (archiving the folder's own tree: the commit's whole tree lacks blobs a mirror may leave out)
git --git-dir="$TINY" archive 44579204a3d8506f5aa76fb6695aa3b81eefe66a:tiny-imagenet-200 \
    words.txt val "${WNIDS[@]/#/train/}" | tar -x -C "$DATA/tiny-imagenet-raw"
"$PY" benchmarks/tiny_imagenet.py

echo "== flowers-17"
fresh flowers-17-raw
git --git-dir="$FLOWERS" archive 4530523c6ae1108db622bd4f9ea76e0ae10fd6a5:17flowers jpg \
  | tar -x -C "$DATA/flowers-17-raw"
"$PY" benchmarks/flowers17.py

echo "== PNGs per set (train, val) and size on disk"
for set in digits fashion-mnist cifar-10 tiny-imagenet flowers-17; do
  printf '%-14s %6d %6d  %s\n' "$set" \
    "$(find "$DATA/$set/train" -type f | wc -l)" "$(find "$DATA/$set/val" -type f | wc -l)" \
    "$(du -sh "$DATA/$set" | cut -f1)"
done
echo "done in ${SECONDS} s"
