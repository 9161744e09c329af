#!/usr/bin/env bash
# Fetch ONNX Runtime's C and C++ API headers (Debian 13 "trixie"'s libonnxruntime-dev) into
# build/ort-headers/include, for the custom-operator library of csrc/ort/ (csrc/ort/build.sh).
#
#   scripts/fetch_ort_headers.sh [DEST]      # DEST defaults to build/ort-headers
#
# apt-get runs with a private state, cache and source list under a temporary folder (a trixie
# source list signed by the Debian archive keyring), so the system's apt configuration and
# package lists are read-only to it; the .deb is checked against the signed index by apt and
# unpacked with dpkg-deb -x. Nothing is installed. The headers stay out of git (build/ is
# ignored). Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian),
# DEBIAN_KEYRING (default /usr/share/keyrings/debian-archive-keyring.gpg).
set -euo pipefail

prog=fetch_ort_headers.sh
die() { echo "$prog: error: $*" >&2; exit 1; }

[ $# -le 1 ] || { echo "$prog: error: expected at most one argument (DEST), got $#" >&2; exit 2; }
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest=${1:-$repo/build/ort-headers}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
keyring=${DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}
marker=.fetched-by-transformer_ext

if [ -f "$dest/$marker" ] && [ -f "$dest/include/onnxruntime_c_api.h" ]; then
  echo "$prog: headers already in $dest/include ($(tr '\n' ' ' <"$dest/VERSION" 2>/dev/null || echo unknown version))"
  exit 0
fi
if [ -e "$dest" ] && [ ! -f "$dest/$marker" ] && [ -n "$(ls -A "$dest" 2>/dev/null)" ]; then
  die "$dest exists and was not written by this script; pass an empty or new folder"
fi
for tool in apt-get dpkg-deb; do
  command -v "$tool" >/dev/null || die "$tool not found (this script needs a Debian-family system)"
done
[ -r "$keyring" ] || die "keyring $keyring not readable (install debian-archive-keyring or set DEBIAN_KEYRING)"

work=$(mktemp -d "${TMPDIR:-/tmp}/ort-headers.XXXXXX")
trap 'rm -rf "$work"' EXIT INT TERM
apt_dir=$work/apt
mkdir -p "$apt_dir"/etc/{apt.conf.d,preferences.d,sources.list.d,trusted.gpg.d} \
  "$apt_dir"/state/lists/partial "$apt_dir"/cache/archives/partial "$work/deb" "$work/root"
: >"$apt_dir/state/status"
echo "deb [signed-by=$keyring] $mirror trixie main" >"$apt_dir/etc/sources.list"
apt=(apt-get -q
  -o "Dir::Etc=$apt_dir/etc"
  -o "Dir::Etc::sourcelist=$apt_dir/etc/sources.list"
  -o "Dir::Etc::sourceparts=$apt_dir/etc/sources.list.d"
  -o "Dir::Etc::parts=$apt_dir/etc/apt.conf.d"
  -o "Dir::Etc::preferencesparts=$apt_dir/etc/preferences.d"
  -o "Dir::Etc::trustedparts=$apt_dir/etc/trusted.gpg.d"
  -o "Dir::State=$apt_dir/state"
  -o "Dir::State::status=$apt_dir/state/status"
  -o "Dir::Cache=$apt_dir/cache"
  -o "Debug::NoLocking=1"
  -o "Acquire::Languages=none"
  -o "APT::Sandbox::User=root")

"${apt[@]}" update --error-on=any >"$work/update.log" 2>&1 || {
  tail -n 5 "$work/update.log" >&2
  die "apt-get update against $mirror trixie failed (no network to the mirror?)"
}
(cd "$work/deb" && "${apt[@]}" download libonnxruntime-dev >"$work/download.log" 2>&1) || {
  tail -n 5 "$work/download.log" >&2
  die "apt-get download libonnxruntime-dev failed"
}
deb=$(ls "$work"/deb/libonnxruntime-dev_*.deb 2>/dev/null | head -n 1)
[ -n "$deb" ] || die "apt-get download wrote no libonnxruntime-dev .deb"
dpkg-deb -x "$deb" "$work/root"
header=$(find "$work/root" -name onnxruntime_c_api.h | head -n 1)
[ -n "$header" ] || die "$(basename "$deb") holds no onnxruntime_c_api.h"

stage=$work/out
mkdir -p "$stage/include"
cp -a "$(dirname "$header")"/. "$stage/include/"
copyright=$(find "$work/root" -path '*/doc/libonnxruntime-dev/copyright' | head -n 1)
[ -z "$copyright" ] || cp "$copyright" "$stage/COPYRIGHT"
dpkg-deb -f "$deb" Package Version >"$stage/VERSION"
grep -m1 '#define ORT_API_VERSION' "$stage/include/onnxruntime_c_api.h" >>"$stage/VERSION" || true
: >"$stage/$marker"
mkdir -p "$(dirname "$dest")"
rm -rf "$dest.partial"
mv "$stage" "$dest.partial"
if [ -e "$dest" ]; then rm -rf "$dest"; fi  # empty, or written by this script (checked above)
mv "$dest.partial" "$dest"
echo "$prog: wrote $dest/include ($(tr '\n' ' ' <"$dest/VERSION"))"
